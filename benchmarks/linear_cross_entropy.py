"""LM-head loss fwd+bwd on the GPU: eager ``cross_entropy(linear(x, W).float(), t)`` (what autocast
training runs), torch.compile of it, and ``opsmath::linear_cross_entropy`` (chunked, no logits tensor),
and Liger-Kernel's fused linear cross-entropy when installed, same inputs, bf16. Tokens 8192 (B8 T1024), hidden 768 / 2048 / 4096, vocab 50304 and 128256. Peak is
memory allocated above the inputs during one fwd+bwd. Numerics: relative error of the loss and of
dx / dW against an fp32 eager run.

    python -m benchmarks linear_cross_entropy [--shapes N,C,V;...] [--softcap 30] [--rounds 5]

``--softcap c`` puts Gemma-2's final ``c * tanh(logits / c)`` in every variant (Liger is left out then).
With ``--rounds`` > 1 the variants are timed A B C A B C and each row gives the median [min-max].
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import opsmath  # noqa: F401
from opsmath.kernels.cross_entropy import cross_entropy_op
from opsmath.kernels.linear_cross_entropy import linear_cross_entropy_op
import opsmath.kernels.linear_cross_entropy as lce
from benchmarks._harness import bench, kernel_ms, new_shape, rel_err, write


CAP = 0.0   # the final-logit softcap every variant applies (``--softcap``; Gemma-2 uses 30)


def capped(z):
    return torch.tanh(z / CAP) * CAP if CAP else z


def eager(x, w, t):
    return F.cross_entropy(capped(F.linear(x, w)).float(), t)


def ours(x, w, t):
    return linear_cross_entropy_op(x, w, None, t, -100, 0.0, "mean", True, False, CAP)[0]


def linear_then_ours(x, w, t):
    """eager linear, then opsmath::cross_entropy on its bf16 logits (what the cross_entropy rewrite
    does where the logits come from elsewhere): no fp32 copy, no log-softmax."""
    return cross_entropy_op(capped(F.linear(x, w)), t, -100, 0.0, "mean")[0]


def liger_impl():
    """Liger-Kernel's fused linear cross-entropy, when its (pure-Python) wheel is installed."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return {}
    return {"liger": lambda x, w, t: liger_fused_linear_cross_entropy(x, w, t)}


SHAPES = [(8192, 768, 50304), (8192, 2048, 32000), (8192, 2048, 128256), (8192, 4096, 128256)]


def main():
    global CAP
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="", help="N,C,V;N,C,V (default: four LM heads)")
    ap.add_argument("--softcap", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds: each times every variant once")
    ap.add_argument("--impls", default="", help="comma-separated subset of the variants")
    ap.add_argument("--chunk-mib", default="", help="also opsmath with chunks of these MiB of logits (512,2048,2048:add; chunked())")
    args = ap.parse_args()
    CAP = args.softcap
    shapes = [tuple(int(v) for v in sh.split(",")) for sh in args.shapes.split(";")] if args.shapes else SHAPES
    rows = []
    compiled = torch.compile(eager)
    impls = {"eager": eager, "torch.compile": compiled, "opsmath": ours, "linear + opsmath CE": linear_then_ours,
             **({} if CAP else liger_impl())}
    if args.impls:
        impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
    for mib in filter(None, args.chunk_mib.split(",")):
        impls[f"opsmath, chunks {mib} MiB"] = chunked(mib)
    for N, C, V in shapes:
        new_shape()
        rows += run_shape(N, C, V, impls, args.rounds)
        torch.cuda.empty_cache()
    print("wrote", write("linear_cross_entropy" + (f"-softcap{CAP:g}" if CAP else ""), dict(rows=rows, softcap=CAP)))


def chunked(spec: str):
    """``ours`` with the op's chunk of logits set to ``MIB`` MiB (``CHUNK_BYTES``); ``MIB:add`` also adds
    each chunk's bf16 dW product to the fp32 accumulator instead of cuBLAS's fp32-output addmm."""
    mib, _, mode = spec.partition(":")

    def fn(x, w, t):
        old = lce.CHUNK_BYTES, lce.DW_FP32_ADDMM
        lce.CHUNK_BYTES, lce.DW_FP32_ADDMM = int(mib) * 2**20, mode != "add"
        try:
            return ours(x, w, t)
        finally:
            lce.CHUNK_BYTES, lce.DW_FP32_ADDMM = old
    return fn


def run_shape(N, C, V, impls, rounds):
    """Each variant's error against fp32 eager and its peak, then ``rounds`` interleaved timings."""
    torch.manual_seed(0)
    x = torch.randn(N, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, C, device="cuda") / C ** 0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")
    x32, w32 = (a.detach().float().requires_grad_() for a in (x, w))
    ref = eager(x32, w32, t)
    ref.backward()

    def step_of(fn):
        def step():
            x.grad = w.grad = None
            loss = fn(x, w, t)
            loss.backward()
            return loss
        return step
    rows = {}
    for name, fn in impls.items():
        loss = step_of(fn)()
        r = bench(step_of(fn), device=True)
        top = sorted(kernel_ms(step_of(fn)).items(), key=lambda kv: -kv[1])[:6]
        print(f"{name}: " + "; ".join(f"{k[:60]} {v:.2f} ms" for k, v in top), flush=True)
        rows[name] = dict(N=N, C=C, V=V, impl=name, err_loss=rel_err(loss, ref), err_dx=rel_err(x.grad, x32.grad),
                          err_dw=rel_err(w.grad, w32.grad), peak_gib=r["peak_bytes"] / 2**30, gpu_ms=r["gpu_ms"],
                          rounds=[r["ms"]], top_kernels=top)
    x32 = w32 = ref = None
    for _ in range(rounds - 1):
        for name, fn in impls.items():
            rows[name]["rounds"].append(bench(step_of(fn))["ms"])
    for row in rows.values():
        row.update(ms=statistics.median(row["rounds"]), ms_min=min(row["rounds"]), ms_max=max(row["rounds"]))
        row["tflops"] = 6 * N * C * V / row["ms"] / 1e9
        print(f"N{N} C{C} V{V} {row['impl']:20} {row['ms']:7.3f} ms [{row['ms_min']:.3f}-{row['ms_max']:.3f}] "
              f"gpu {row['gpu_ms']:7.3f} {row['tflops']:6.1f} TFLOP/s peak {row['peak_gib']:6.2f} GiB  "
              f"err loss {row['err_loss']:.1e} dx {row['err_dx']:.1e} dW {row['err_dw']:.1e}", flush=True)
    return list(rows.values())


if __name__ == "__main__":
    main()
