"""Every Triton kernel compiles for the H200 (sm_90) the way its op launches it, without a GPU.

CI runs the kernels in Triton's interpreter, which accepts programs the compiler rejects: once a
helper that returned a block on one path and a scalar on the other passed every interpreter test and was
a ``CompilationError`` on the H200. Here each op runs once on CPU under the interpreter, in bf16 and
fp32 and with each of its flags; every launch is recorded as the GPU's JIT would specialize it
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


def _exercise(dtype):
    """Run every op forward and backward once with each flag it has, in ``dtype``."""
    from opsmath.kernels.attention import attention_op
    from opsmath.kernels.attention_tuning import configs_for, forced_config
    from opsmath.kernels.bias_gelu import bias_gelu
    from opsmath.kernels.cross_entropy import cross_entropy
    from opsmath.kernels.dropout_add_norm import dropout_add_norm_op
    from opsmath.kernels.linear_cross_entropy import linear_cross_entropy
    from opsmath.kernels.softmax import scaled_softmax
    from opsmath.kernels.swiglu import swiglu
    from opsmath.optim import AdamW

    def leaf(*shape, dt=dtype):
        return torch.randn(*shape, dtype=dt).requires_grad_()

    def backward(out):
        (out.float() * 0.5).sum().backward()

    seed = torch.tensor(7)
    backward(swiglu(leaf(3, 40), leaf(3, 40)))
    for approx in ("none", "tanh"):
        for p in (0.0, 0.1):
            backward(bias_gelu(leaf(5, 40), leaf(40), approx, p, seed))
    for width, bias in ((40, True), (40, False), (9000, True)):
        backward(scaled_softmax(leaf(2, width), leaf(width) if bias else None, 0.5))
    for rms, p, affine in ((False, 0.1, True), (True, 0.0, True), (False, 0.0, False)):
        w = leaf(48) if affine else None
        b = leaf(48) if affine and not rms else None
        out, h, _ = dropout_add_norm_op(leaf(6, 48), leaf(6, 48), w, b, rms, 1e-5, p, seed, dtype)
        backward(out.float().sum() + h.float().sum())
    # every launch configuration the row-kernel tuner may pick (kernels/_common.tuned_config)
    from unittest import mock

    from opsmath.kernels import bias_gelu as bg, dropout_add_norm as dan
    for i in range(3):
        pick = lambda op, key, configs, run, device: list(configs.values())[i % len(configs)]  # noqa: E731
        with mock.patch.object(bg, "tuned_config", pick), mock.patch.object(dan, "tuned_config", pick):
            backward(bias_gelu(leaf(5, 40), leaf(40), "none", 0.1, seed))
            out, h, _ = dropout_add_norm_op(leaf(6, 48), leaf(6, 48), leaf(48), leaf(48), False, 1e-5, 0.1, seed,
                                            dtype)
            backward(out.float().sum() + h.float().sum())
    t = torch.randint(0, 300, (8,))
    for smoothing in (0.0, 0.1):
        backward(cross_entropy(leaf(8, 300), t, -100, smoothing, "mean"))
        backward(linear_cross_entropy(leaf(8, 16), leaf(300, 16), leaf(300), t, -100, smoothing, "mean"))
    with torch.no_grad():
        linear_cross_entropy(leaf(8, 16), leaf(300, 16), None, t, -100, 0.0, "sum")
    # attention in the block configurations the GPU launches (its kernels take ~10 s each to compile,
    # so the flags are spread over three bf16 cases and one fp32 case)
    cases = [(64, 1, True, False, False, 0.0)] if dtype == torch.float32 else [
        (64, 2, True, False, False, 0.0), (128, 2, False, True, False, 0.1), (32, 1, True, False, True, 0.0)]
    for D, Hkv, causal, bias, mask, p in cases:
        cfg = configs_for(D)[1 if bias else 0]
        q, k, v = leaf(1, 2, 20, D), leaf(1, Hkv, 20, D), leaf(1, Hkv, 20, D)
        bb = leaf(1, 1, 20, 20, dt=dtype) if bias else None
        mm = torch.rand(1, 1, 20, 20) > 0.2 if mask else None
        if mm is not None:
            mm[..., 0] = True
        with forced_config(cfg):
            out = attention_op(q, k, v, bb, mm, float("-inf"), causal, D ** -0.5, p, seed)[0]
            backward(out)
    for master, clip in ((False, 1.0), (True, None)):
        params = [torch.nn.Parameter(torch.randn(40, dtype=dtype)), torch.nn.Parameter(torch.randn(3, 5, dtype=dtype))]
        for prm in params:
            prm.grad = torch.randn_like(prm)
        AdamW(params, lr=1e-3, master_weights=master, max_grad_norm=clip).step()


def test_every_kernel_compiles_for_sm90(triton_on_cpu):
    pytest.importorskip("triton.backends.nvidia")
    if torch.cuda.is_available():
        pytest.skip("on a GPU the kernel tests compile every kernel for it already")
    from opsmath.kernels._aot import record_launches
    launches: list = []
    torch.manual_seed(0)
    with record_launches(launches):
        for dtype in (torch.float32, torch.bfloat16):
            _exercise(dtype)
    unique = {json.dumps(r, sort_keys=True): r for r in launches}
    kernels = {(r["module"], r["kernel"]) for r in unique.values()}
    assert len(kernels) >= 12, sorted(kernels)      # every kernel family above launched something
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
