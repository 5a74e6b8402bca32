"""SwiGLU, bias-GELU and scaled/masked softmax fwd+bwd on the GPU: opsmath's kernels vs eager, torch.compile
of eager and Liger-Kernel where it has the op (``LigerSiLUMulFunction``; it has no bias-GELU or masked
softmax), same inputs, numerics against float64 in the same run. Rows 16384 x width 768 / 1024 / 4096 /
8192, bf16 and fp32.

Effective TB/s = minimal bytes / time. Minimal bytes, in row-tensors of M x N: SwiGLU 8 (forward reads a,
b and writes y; backward reads dy, a, b and writes da, db); bias-GELU 5 (forward reads x, writes y;
backward reads dy, x, writes dx; the bias and its gradient are one row); scaled softmax with a padding
bias of shape (M/128, 1, N) counted as 5 (x read, y written; y, dy read, dx written; the bias is small).

    python -m benchmarks activations [--quick]
    python -m benchmarks activations --smoke     # tiny, on CPU: checks the script, measures nothing
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import opsmath  # noqa: F401
from opsmath.kernels.bias_gelu import bias_gelu
from opsmath.kernels.swiglu import swiglu
from benchmarks._harness import bench, new_shape, rel_err, write


def liger_swiglu():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return {}
    return {"liger": lambda a, b: LigerSiLUMulFunction.apply(a, b)}


def eager_swiglu(a, b):
    return F.silu(a) * b


def ops(kind):
    """name -> (fn over the inputs, impls, row-tensors moved)."""
    if kind == "swiglu":
        impls = {"eager": eager_swiglu, "compile": torch.compile(eager_swiglu), "opsmath": swiglu, **liger_swiglu()}
        return impls, 8, 2
    if kind == "scaled_softmax":
        from opsmath.kernels.softmax import scaled_softmax

        def eager_sm(x, b):
            return torch.softmax(x * 0.125 + b, -1)
        return {"eager": eager_sm, "compile": torch.compile(eager_sm),
                "opsmath": lambda x, b: scaled_softmax(x, b, 0.125)}, 5, 1
    approximate = "tanh" if kind == "bias_gelu_tanh" else "none"

    def eager(x, b):
        return F.gelu(x + b, approximate=approximate)
    impls = {"eager": eager, "compile": torch.compile(eager),
             "opsmath": lambda x, b: bias_gelu(x, b, approximate)}
    return impls, 5, 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    M, rows = (256 if args.smoke else 16384), []
    widths = (96,) if args.smoke else (1024, 4096) if args.quick else (768, 1024, 4096, 8192)
    for kind in ("swiglu", "bias_gelu_erf", "bias_gelu_tanh", "scaled_softmax"):
        impls, tensors, n_full = ops(kind)
        for dt in (torch.bfloat16, torch.float32):
            for N in widths:
                new_shape()
                torch.manual_seed(0)
                inputs = [torch.randn(M, N, device=dev, dtype=dt, requires_grad=True) for _ in range(n_full)]
                if kind == "scaled_softmax":   # a padding mask per group of 128 rows: (M/128, 1, N)
                    inputs = [torch.randn(M // 128, 128, N, device=dev, dtype=dt, requires_grad=True)]
                    pad = torch.where(torch.rand(M // 128, 1, N, device=dev) < 0.1, float("-inf"), 0.0)
                    pad[..., 0] = 0.0
                    inputs.append(pad.to(dt))
                elif n_full == 1:
                    inputs.append(torch.randn(N, device=dev, dtype=dt, requires_grad=True))
                dy = torch.randn(inputs[0].shape, device=dev, dtype=dt)
                ref_in = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
                ref = impls["eager"](*ref_in)
                ref.backward(dy.double())
                for name, fn in impls.items():
                    row = dict(op=kind, dtype=str(dt).replace("torch.", ""), M=M, N=N, impl=name)
                    try:
                        for t in inputs:
                            t.grad = None
                        out = fn(*inputs)
                        out.backward(dy)
                        row["err_out"] = rel_err(out, ref)
                        row["err_grad"] = max(rel_err(t.grad, r.grad) for t, r in zip(inputs, ref_in)
                                              if t.requires_grad)

                        def step():
                            for t in inputs:
                                t.grad = None
                            fn(*inputs).backward(dy)
                        t = bench(step, device=True) if dev == "cuda" else dict(ms=float("nan"), gpu_ms=float("nan"),
                                                                                peak_bytes=0)
                        nbytes = tensors * M * N * inputs[0].element_size()
                        row.update(ms=t["ms"], tbps=nbytes / t["ms"] / 1e9, peak_gib=t["peak_bytes"] / 2**30,
                                   gpu_ms=t["gpu_ms"], tbps_gpu=nbytes / t["gpu_ms"] / 1e9)
                    except Exception as e:  # recorded, not fatal
                        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                    rows.append(row)
                inputs = dy = ref = ref_in = None
                if dev == "cuda":
                    torch.cuda.empty_cache()
    path = write("activations", dict(rows=rows)) if not args.smoke else "(smoke: nothing written)"
    print(f"{'op':15} {'dtype':9} {'N':>5} {'impl':8} {'TB/s':>6} {'ms':>7} {'gpuTB/s':>7} {'gpu ms':>7} {'GiB':>6} "
          f"{'err':>9} {'err_grad':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['op']:15} {r['dtype']:9} {r['N']:5} {r['impl']:8} {r['error'][:70]}")
            continue
        print(f"{r['op']:15} {r['dtype']:9} {r['N']:5} {r['impl']:8} {r['tbps']:6.2f} {r['ms']:7.3f} "
              f"{r['tbps_gpu']:7.2f} {r['gpu_ms']:7.3f} {r['peak_gib']:6.2f} {r['err_out']:9.2e} {r['err_grad']:9.2e}")
    print("wrote", path)


if __name__ == "__main__":
    main()
