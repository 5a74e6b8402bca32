"""Static statistics of opsmath's Triton kernels for the H200, on a machine without a GPU.

An op runs once at the asked width under Triton's interpreter (each launch recorded as the GPU's JIT would
specialize it, ``opsmath.kernels._aot``), then every launched kernel is compiled for sm_90 and read back:
SASS instructions (and the share that are tensor-core, async-copy and spill instructions), registers per
thread, shared memory and how many programs fit on one SM at once (its registers, shared memory and warp
slots). It measures no time: it tells where a kernel spends instructions and occupancy before device time
is spent (BENCHMARKS.md's kernel static analysis section uses it for bias-GELU and dropout-add-norm).

    python -m benchmarks sass_stats --op bias_gelu --dtype bf16 --width 8192 [--config 0] [--tanh]
    python -m benchmarks sass_stats --op dropout_add_norm --width 1024 --config 3
    python -m benchmarks sass_stats --op attention --width 64          # width = head dim
    python -m benchmarks sass_stats --op cross_entropy --width 50304   # width = vocabulary

``--config i`` forces the tuner's i-th candidate launch configuration (each kernel of the op takes the
i-th of its own list, modulo its length).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

from benchmarks import ROOT, command


def record(op: str, dtype: str, width: int, config: int, tanh: bool) -> list:
    """Run in a child process with the interpreter on: the op's launches as records."""
    import torch
    from unittest import mock

    from opsmath.kernels import _aot, bias_gelu as bg, dropout_add_norm as dan
    from opsmath.kernels.attention.tuning import configs_for, forced_config
    dt = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype])

    def pick(op_name, key, configs, run, device):
        return list(configs.values())[config % len(configs)]

    def leaf(*shape):
        return torch.randn(*shape, dtype=dt, requires_grad=True)
    records: list = []
    with _aot.record_launches(records), mock.patch.object(bg, "tuned_config", pick), \
            mock.patch.object(dan, "tuned_config", pick):
        if op == "bias_gelu":
            bg.bias_gelu(leaf(16, width), leaf(width), "tanh" if tanh else "none").float().sum().backward()
        elif op == "dropout_add_norm":
            out, h, _ = dan.dropout_add_norm_op(leaf(16, width), leaf(16, width), leaf(width), leaf(width), False,
                                                1e-5, 0.1, torch.tensor(3), dt)
            (out.float().sum() + h.float().sum()).backward()
        elif op == "attention":
            from opsmath.kernels.attention import attention_op
            q, k, v = leaf(1, 16, 128, width), leaf(1, 16, 128, width), leaf(1, 16, 128, width)
            cfgs = configs_for(width)
            with forced_config(cfgs[config % len(cfgs)]):
                out = attention_op(q, k, v, None, None, float("-inf"), True, width ** -0.5, 0.0, None)[0]
                out.float().sum().backward()
        elif op == "cross_entropy":    # width = vocabulary
            from opsmath.kernels.cross_entropy import cross_entropy
            cross_entropy(leaf(16, width), torch.randint(0, width, (16,))).backward()
        else:
            raise SystemExit(f"unknown op {op!r}: bias_gelu, dropout_add_norm, attention, cross_entropy")
    return list({json.dumps(r, sort_keys=True): r for r in records}.values())


def sass_of(cubin: bytes) -> tuple[list[str], str]:
    """(instruction mnemonics, resource usage line) of a cubin, from the cuobjdump Triton ships."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops.append(m.group(1))
    return ops, res


def stats(rec: dict) -> dict:
    from opsmath.kernels._aot import compile_record
    from opsmath.kernels._common import programs_per_sm
    k = compile_record(rec)
    ops, res = sass_of(k.asm["cubin"])
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    smem = k.metadata.shared
    warps = rec["options"].get("num_warps", 4)
    fit = programs_per_sm(regs, smem, warps)
    c = Counter(ops)
    return dict(kernel=rec["kernel"], constexprs={k: v for k, v in rec["constexprs"].items() if k.isupper()},
                warps=warps, stages=rec["options"].get("num_stages"), instructions=len(ops), regs=regs,
                shared=smem, programs_per_sm=fit, warps_per_sm=fit * warps, spills=c["STL"],
                tensor_core=c["HGMMA"] + c["HMMA"], async_copy=c["LDGSTS"] + c["UTMALDG"], top=c.most_common(8))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="bias_gelu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--config", type=int, default=0)
    ap.add_argument("--tanh", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--record", action="store_true", help=argparse.SUPPRESS)   # the child's side
    args = ap.parse_args()
    if args.record:
        print(json.dumps(record(args.op, args.dtype, args.width, args.config, args.tanh)))
        return
    if os.environ.get("TRITON_INTERPRET") == "1":   # compiling needs real kernels: start again without it
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OPSMATH_TRITON_ON_CPU")}
        raise SystemExit(subprocess.run(command("sass_stats", *sys.argv[1:]), cwd=ROOT, env=env).returncode)
    env = dict(os.environ, TRITON_INTERPRET="1", OPSMATH_TRITON_ON_CPU="1")
    child = subprocess.run(command("sass_stats", "--record", *sys.argv[1:]), cwd=ROOT, env=env,
                           capture_output=True, text=True)
    if child.returncode:
        raise SystemExit(child.stderr[-3000:])
    rows = [stats(r) for r in json.loads(child.stdout.strip().splitlines()[-1])]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{args.op} {args.dtype} width {args.width} config {args.config}, sm_90 (triton's compiler here)")
    for r in rows:
        print(f"{r['kernel']:16} {r['constexprs']} warps {r['warps']} stages {r['stages']}: {r['instructions']} "
              f"instructions, {r['regs']} regs, {r['shared']} B shared -> {r['programs_per_sm']} programs "
              f"({r['warps_per_sm']} warps) per SM; spills {r['spills']}, tensor-core {r['tensor_core']}, "
              f"async copies {r['async_copy']}; top {r['top']}")


if __name__ == "__main__":
    main()
