"""Every Triton kernel compiles for the H200 (sm_90) the way its op launches it, without a GPU.

CI runs the kernels in Triton's interpreter, which accepts programs the compiler rejects: once a
helper that returned a block on one path and a scalar on the other passed every interpreter test and was
a ``CompilationError`` on the H200. Here each op runs once on CPU under the interpreter, in bf16 and
fp32 and with each of its flags (its op spec's ``exercise``); every launch is recorded as the GPU's JIT would specialize it
(``opsmath.kernels._aot``: argument types, constants, divisibility, warps, stages) and then compiled ahead
of time for ``GPUTarget("cuda", 90, 32)`` in a subprocess without the interpreter: the compiler's
frontend, TTGIR, LLVM and ptxas, as on the GPU.

    python tests/test_kernels_compile_for_hopper.py < launches.json   # the subprocess side
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch


def test_every_kernel_compiles_for_sm90(triton_on_cpu):
    pytest.importorskip("triton.backends.nvidia")
    if torch.cuda.is_available():
        pytest.skip("on a GPU the kernel tests compile every kernel for it already")
    from opsmath.kernels._aot import record_launches
    from opsmath.kernels import SPECS
    launches: list = []
    torch.manual_seed(0)
    for spec in [s for s in SPECS.values() if s.triton]:   # every op's spec says how to reach its launches
        assert spec.exercise is not None, f"op spec {spec.family} has no exercise"
        mine: list = []
        with record_launches(mine):
            for dtype in (torch.float32, torch.bfloat16):
                spec.exercise(dtype)
        assert mine, f"{spec.family}: exercise launched no Triton kernel"
        launches += mine
    unique = {json.dumps(r, sort_keys=True): r for r in launches}
    kernels = {(r["module"], r["kernel"]) for r in unique.values()}
    assert len(kernels) >= 12, sorted(kernels)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OPSMATH_TRITON_ON_CPU")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(list(unique.values())), text=True,
                          capture_output=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]


def _compile_all(records) -> list[str]:
    """Compile each record for sm_90; the failures, one line each."""
    from opsmath.kernels._aot import compile_record
    failures = []
    for r in records:
        try:
            compile_record(r)
        except Exception as e:   # every failure is reported, not just the first
            chain, err = [], e          # the last lines of each exception in the chain: where and why
            while err is not None:
                lines = [ln for ln in str(err).splitlines() if ln.strip()]
                chain.append(f"{type(err).__name__}: " + " | ".join(lines[:1] + lines[-2:]))
                err = err.__cause__
            failures.append(f"{r['module']}.{r['kernel']} {r['constexprs']} {r['options']}: " + " <- ".join(chain))
    return failures


if __name__ == "__main__":
    from concurrent.futures import ProcessPoolExecutor
    recs = json.load(sys.stdin)
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        bad = [line for lines in pool.map(_compile_all, [[r] for r in recs]) for line in lines]
    print(f"{len(recs)} launches compiled for sm_90, {len(bad)} failed")
    for line in bad:
        print(line)
    sys.exit(1 if bad else 0)
