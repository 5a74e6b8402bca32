"""LM-head loss fwd+bwd on the GPU: eager ``cross_entropy(linear(x, W).float(), t)`` (what autocast
training runs), torch.compile of it, and ``opsmath::linear_cross_entropy`` (chunked, no logits tensor),
and Liger-Kernel's fused linear cross-entropy when installed, same inputs, bf16. Tokens 8192 (B8 T1024), hidden 768 / 2048 / 4096, vocab 50304 and 128256. Peak is
memory allocated above the inputs during one fwd+bwd. Numerics: relative error of the loss and of
dx / dW against an fp32 eager run.

    python benchmarks/linear_cross_entropy.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import opsmath  # noqa: F401
from opsmath.kernels.cross_entropy import cross_entropy_op
from opsmath.kernels.linear_cross_entropy import linear_cross_entropy_op
from _harness import bench, rel_err, write


def eager(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t)


def ours(x, w, t):
    return linear_cross_entropy_op(x, w, None, t, -100, 0.0, "mean", True)[0]


def linear_then_ours(x, w, t):
    """eager linear, then opsmath::cross_entropy on its bf16 logits (what the cross_entropy rewrite
    does where the logits come from elsewhere): no fp32 copy, no log-softmax."""
    return cross_entropy_op(F.linear(x, w), t, -100, 0.0, "mean")[0]


def liger_impl():
    """Liger-Kernel's fused linear cross-entropy, when its (pure-Python) wheel is installed."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return {}
    return {"liger": lambda x, w, t: liger_fused_linear_cross_entropy(x, w, t)}


def main():
    rows = []
    compiled = torch.compile(eager)
    impls = {"eager": eager, "torch.compile": compiled, "opsmath": ours, "linear + opsmath CE": linear_then_ours,
             **liger_impl()}
    for N, C, V in [(8192, 768, 50304), (8192, 2048, 32000), (8192, 2048, 128256), (8192, 4096, 128256)]:
        torch.manual_seed(0)
        x = torch.randn(N, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(V, C, device="cuda") / C ** 0.5).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, V, (N,), device="cuda")
        x32, w32 = (a.detach().float().requires_grad_() for a in (x, w))
        ref = eager(x32, w32, t)
        ref.backward()
        for name, fn in impls.items():
            def step():
                x.grad = w.grad = None
                loss = fn(x, w, t)
                loss.backward()
                return loss
            loss = step()
            row = dict(N=N, C=C, V=V, impl=name, err_loss=rel_err(loss, ref), err_dx=rel_err(x.grad, x32.grad),
                       err_dw=rel_err(w.grad, w32.grad))
            r = bench(step)
            row.update(ms=r["ms"], peak_gib=r["peak_bytes"] / 2**30,
                       tflops=6 * N * C * V / r["ms"] / 1e9)
            rows.append(row)
            print(f"N{N} C{C} V{V} {name:14} {r['ms']:7.3f} ms {row['tflops']:6.1f} TFLOP/s "
                  f"peak {row['peak_gib']:6.2f} GiB  err loss {row['err_loss']:.1e} dx {row['err_dx']:.1e} "
                  f"dW {row['err_dw']:.1e}", flush=True)
        x = w = x32 = w32 = ref = None  # free before the next shape
        torch.cuda.empty_cache()
    print("wrote", write("linear_cross_entropy", dict(rows=rows)))


if __name__ == "__main__":
    main()
