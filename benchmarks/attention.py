"""Attention fwd+bwd on the GPU: opsmath's Triton kernel vs eager matmul-softmax-matmul, torch.compile of
it (``--compile``), each SDPA backend and the opsmath rewrite of hand-written attention (whichever kernel
it measured fastest: its own or an SDPA backend), same inputs, bf16. TFLOP/s counts 4*B*H*S^2*D*3.5 (fwd+bwd),
halved when causal, by wall time (``ms``: what a lone call costs, host included) and by device time
(``gpu_ms``: the kernels' sum, what the call costs in a step whose host runs ahead). Numerics: relative
error of the output and dQ against an fp32 SDPA (math) run.

    python -m benchmarks attention [--quick] [--compile]
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import opsmath
from opsmath.kernels.attention import attention_op
from benchmarks._harness import bench, new_shape, rel_err, write

SHAPES = [(8, 16, 1024, 64), (4, 16, 2048, 128), (2, 16, 4096, 128), (1, 16, 8192, 128)]


def sdpa(backend):
    def run(q, k, v, causal, bias, p):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, is_causal=causal,
                                                  enable_gqa=k.shape[1] != q.shape[1])
    return run


def sdpa_default(q, k, v, causal, bias, p):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, is_causal=causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


class HandWritten(torch.nn.Module):
    """Attention as research code writes it (GQA by repeat_interleave): what the rewrite sees."""

    def forward(self, q, k, v, bias, causal: bool, p: float):
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if causal:
            S = q.shape[-2]
            s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        if bias is not None:
            s = s + bias
        return F.dropout(F.softmax(s.float(), -1).to(q.dtype), p, training=p > 0) @ v


_HAND = HandWritten()


def eager(q, k, v, causal, bias, p):
    return _HAND(q, k, v, bias, causal, p)


def rewrite():
    """opsmath.optimize of HandWritten, captured per case: whatever backend the rewrite picks."""
    torch._dynamo.reset()
    model = opsmath.optimize(HandWritten())
    picked = {}

    def run(q, k, v, causal, bias, p):
        out = model(q, k, v, bias, causal, p)
        if not picked:
            ms = [m for g in opsmath.report(model).graphs for m in g.matches]
            picked["backend"] = ms[0].details.get("backend") if ms else "not rewritten"
        return out
    run.picked = picked
    return run


def ours(q, k, v, causal, bias, p):
    return attention_op(q, k, v, bias, None, float("-inf"), causal, 1 / math.sqrt(q.shape[-1]), p,
                        torch.randint(0, 2**31 - 1, ()))[0]


def tune_ours(q, k, causal, bias, p) -> str:
    """opsmath's own kernel autotuned over its block configurations for this shape (vendors left out),
    so its row measures the configuration a user's process would run, whatever ran before in this one;
    returns that configuration's name."""
    from opsmath.kernels.autotune import cached
    from opsmath.kernels.attention.tuning import OWN_ONLY, bucket_key, choose
    choose(q.shape, k.shape, q.dtype, q.device, None if bias is None else bias.shape, None, float("-inf"),
           causal, 1 / math.sqrt(q.shape[-1]), p, vendors=False)
    return cached("attention", bucket_key(q, k, bias is not None, False, causal, p) + OWN_ONLY) or "default"


def case(name, B, H, Hkv, S, D, causal, p, padding, impls):
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, H, S, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, device=dev, dtype=dt, requires_grad=True)
    bias = None
    if padding:
        keep = torch.arange(S, device=dev)[None, :] < torch.randint(S // 2, S + 1, (B, 1), device=dev)
        bias = torch.zeros(B, 1, 1, S, device=dev, dtype=dt).masked_fill(~keep[:, None, None, :], torch.finfo(dt).min)
    do = torch.randn(B, H, S, D, device=dev, dtype=dt)
    flops = 4 * B * H * S * S * D * 3.5 / (2 if causal else 1)
    ref = None
    if p == 0:
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        rb = bias.float() if bias is not None else None
        with sdpa_kernel(SDPBackend.MATH):
            o32 = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=rb, is_causal=causal,
                                                 enable_gqa=Hkv != H)
        o32.backward(do.float())
        ref = (o32.detach(), q32.grad)
    rows = []
    impls = dict(impls, opsmath_rewrite=rewrite())
    for iname, fn in impls.items():
        row = dict(case=name, impl=iname, B=B, H=H, Hkv=Hkv, S=S, D=D, causal=causal, dropout=p, padding=padding)
        try:
            if fn is ours:
                row["picked"] = tune_ours(q, k, causal, bias, p)

            def step():
                q.grad = k.grad = v.grad = None
                out = fn(q, k, v, causal, bias, p)
                out.backward(do)
                return out
            out = step()
            if ref is not None:
                row.update(err_out=rel_err(out, ref[0]), err_dq=rel_err(q.grad, ref[1]))
            r = bench(step, device=True)
            row.update(ms=r["ms"], tflops=flops / r["ms"] / 1e9, peak_gib=r["peak_bytes"] / 2**30,
                       gpu_ms=r["gpu_ms"], tflops_gpu=flops / r["gpu_ms"] / 1e9)
            if hasattr(fn, "picked"):
                row["picked"] = fn.picked.get("backend")
        except Exception as e:  # a backend that does not support the case: recorded, not fatal
            row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--cases", default="", help="only cases whose name contains this text")
    args = ap.parse_args()
    impls = {"eager": eager, "sdpa_default": sdpa_default, "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
             "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
             "opsmath_kernel": ours}
    if args.compile:
        impls["compile_eager"] = torch.compile(eager)
    shapes = SHAPES[:2] if args.quick else SHAPES
    todo = [(f"B{B} H{H} S{S} D{D} {'causal' if c else 'full'}", B, H, H, S, D, c, 0.0, False, impls)
            for (B, H, S, D) in shapes for c in (True, False)]
    todo += [("dropout0.1 causal", 4, 16, 16, 2048, 128, True, 0.1, False, impls),
             ("padding mask", 4, 16, 16, 2048, 128, False, 0.0, True, impls),
             ("GQA 32x8 causal", 2, 32, 8, 2048, 128, True, 0.0, False, impls)]
    rows, path = [], "(no case matched)"
    for spec in todo:
        if args.cases in spec[0]:
            new_shape()
            rows += case(*spec)
            path = write("attention", dict(rows=rows))   # after every case: a timeout keeps what ran
    print(f"{'case':28} {'impl':15} {'TFLOP/s':>8} {'ms':>8} {'gpu TF/s':>8} {'gpu ms':>8} {'GiB':>6} "
          f"{'err_out':>9} {'err_dq':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:28} {r['impl']:15} {r['error'][:60]}")
        else:
            print(f"{r['case']:28} {r['impl']:15} {r['tflops']:8.1f} {r['ms']:8.3f} {r['tflops_gpu']:8.1f} "
                  f"{r['gpu_ms']:8.3f} {r['peak_gib']:6.2f} "
                  f"{r.get('err_out', float('nan')):9.2e} {r.get('err_dq', float('nan')):9.2e} {r.get('picked', '')}")
    print("wrote", path)


if __name__ == "__main__":
    main()
