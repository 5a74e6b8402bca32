"""Attention variants, forward + backward, bf16: opsmath's kernel against what a user has for the same
function, interleaved in one process. ``--kind softcap``: logit softcapping (Gemma-2:
``S = c * tanh(scale QK^T / c)``, causal); ``--kind window``: causal sliding-window attention (Mistral,
Gemma-2/3: query i sees keys i - w < j <= i); ``--kind alibi``: causal attention with BLOOM's ALiBi
(``alibi_variants``).

Softcap variants (same inputs, same ``dO``):
- ``compiled eager``: the softcapped attention as written (scores, tanh, softmax, P V) under ``torch.compile``;
- ``flex_attention``: ``torch.compile(flex_attention)`` with a softcap ``score_mod`` and a causal block mask;
- ``opsmath``: ``opsmath::attention(softcap=c)`` in the block configuration its tuner picks for the shape;
- ``SDPA causal, no softcap``: not the same function, the floor a vendor kernel sets without the cap.

Window variants: ``SDPA + mask`` (the materialized boolean mask HF's SDPA path builds, on the backend
SDPA picks for it), ``compiled eager`` (the mask as written, under ``torch.compile``), ``flex_attention``
(compiled, a sliding-window block mask), ``opsmath`` (``window=w``: blocks outside the band skipped) and
``SDPA causal, no window`` (the full causal cost, not the same function).

Per case: ``--rounds`` rounds, each timing every variant once (``do_bench`` median, CUDA events), A B C A B C;
the row is the median and spread of the rounds, GPU kernel time (torch.profiler), and the output's and
dQ's relative error against an fp32 reference.

    python -m benchmarks attention_variants [--kind softcap|window|alibi] [--rounds 5] [--cap 50]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from benchmarks._harness import bench, kernel_ms, new_shape, rel_err, write
from opsmath.kernels.attention import attention_op
from opsmath.kernels.attention.tuning import backend_for, eager_same_dtype

CASES = [(4, 16, 2048, 128), (4, 8, 2048, 256), (2, 16, 4096, 128)]   # B, H, S, D (D256: Gemma-2's head dim)
ALIBI_CASES = [(4, 16, 2048, 128), (2, 16, 4096, 128)]
WINDOW_CASES = [(4, 16, 2048, 128, 512), (2, 16, 8192, 128, 1024), (1, 32, 8192, 128, 4096)]   # ..., window


def window_variants(q, k, v, w, scale):
    """The sliding-window variants of the module docstring, each ``(q, k, v) -> out``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    S = q.shape[2]
    i = torch.arange(S, device=q.device)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
    block = create_block_mask(lambda b, h, qi, kj: (kj <= qi) & (kj > qi - w), None, None, S, S, device=q.device)
    flex = torch.compile(flex_attention)
    eager = torch.compile(lambda q, k, v: eager_same_dtype(q, k, v, None, None, float("-inf"), True, scale, window=w))
    backend_for(q, k, None, None, float("-inf"), True, scale, 0.0, False, 0.0, w)   # tunes the block configuration
    seed = torch.tensor(0, device=q.device)
    return {
        "SDPA + mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale),
        "compiled eager": eager,
        "flex_attention": lambda q, k, v: flex(q, k, v, block_mask=block, scale=scale),
        "opsmath": lambda q, k, v: attention_op(q, k, v, None, None, float("-inf"), True, scale, 0.0, seed, 0.0, w)[0],
        "SDPA causal, no window": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale),
    }


def alibi_slopes(H: int, device) -> torch.Tensor:
    """BLOOM's ALiBi slopes for ``H`` heads (a power of two): ``2^(-8 (h + 1) / H)``."""
    return torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=device)


def alibi_bias(q) -> torch.Tensor:
    """BLOOM's ALiBi as the additive bias it adds inside ``baddbmm``: ``slope_h * j`` over key j,
    (B, H, 1, S) in q's dtype (shift-invariant per row, so the same softmax as ``slope_h * (j - i)``)."""
    B, H, S, _ = q.shape
    return (alibi_slopes(H, q.device)[:, None] * torch.arange(S, device=q.device)).to(q.dtype).view(1, H, 1, S) \
        .expand(B, H, 1, S)


def alibi_variants(q, k, v, scale):
    """Causal attention with ALiBi: SDPA with the bias and the causal mask materialized (B, H, S, S),
    compiled eager (BLOOM's chain under ``torch.compile``), flex with a ``score_mod``, opsmath's kernel."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    B, H, S, _ = q.shape
    bias, slopes = alibi_bias(q), alibi_slopes(H, q.device)
    i = torch.arange(S, device=q.device)
    full = bias.masked_fill(i[None, None, None, :] > i[None, None, :, None], float("-inf"))   # (B, H, S, S)
    block = create_block_mask(lambda b, h, qi, kj: kj <= qi, None, None, S, S, device=q.device)
    flex = torch.compile(flex_attention)
    eager = torch.compile(lambda q, k, v: eager_same_dtype(q, k, v, bias, None, float("-inf"), True, scale))
    chosen = backend_for(q, k, tuple(bias.shape), None, float("-inf"), True, scale, 0.0, False)
    print(f"B{B} H{H} S{S}: the rewrite's tuner picks {chosen}", flush=True)
    seed = torch.tensor(0, device=q.device)
    return {
        "SDPA + materialized bias": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=scale),
        "compiled eager": eager,
        "flex_attention": lambda q, k, v: flex(q, k, v, score_mod=lambda s, b, h, qi, kj: s + slopes[h] * kj,
                                               block_mask=block, scale=scale),
        "opsmath": lambda q, k, v: attention_op(q, k, v, bias, None, float("-inf"), True, scale, 0.0, seed)[0],
        "SDPA causal, no ALiBi": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale),
    }


def variants(q, k, v, cap, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    S = q.shape[2]
    block = create_block_mask(lambda b, h, i, j: j <= i, None, None, S, S, device=q.device)
    flex = torch.compile(flex_attention)
    eager = torch.compile(lambda q, k, v: eager_same_dtype(q, k, v, None, None, float("-inf"), True, scale,
                                                           softcap=cap))
    backend_for(q, k, None, None, float("-inf"), True, scale, 0.0, False, cap)   # tunes the block configuration
    seed = torch.tensor(0, device=q.device)
    return {
        "compiled eager": eager,
        "flex_attention": lambda q, k, v: flex(q, k, v, score_mod=lambda s, b, h, i, j: cap * torch.tanh(s / cap),
                                               block_mask=block, scale=scale),
        "opsmath": lambda q, k, v: attention_op(q, k, v, None, None, float("-inf"), True, scale, 0.0, seed, cap)[0],
        "SDPA causal, no softcap": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                  scale=scale),
    }


def run_case(B, H, S, D, cap, rounds, window=0, alibi=False):
    new_shape()
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    # softcap: scores of tens, where a cap of 50 bends them (Gemma-2's scores reach the cap)
    cap = 0.0 if window or alibi else cap
    scale = D ** -0.5 * (8 if cap else 1)
    ref_in = [t.detach().float()[:1].requires_grad_() for t in (q, k, v)]   # fp32 reference on batch 0
    # ALiBi's reference adds the bias the model holds (bf16, slope * j rounded) in fp32: the function every
    # variant but flex computes (flex's score_mod forms slope * j in fp32, a rounding apart: its error shows it)
    ref = eager_same_dtype(*ref_in, alibi_bias(q[:1]).float() if alibi else None, None, float("-inf"), True, scale,
                           softcap=cap, window=window)
    ref.backward(do[:1].float())
    fns = window_variants(q, k, v, window, scale) if window else alibi_variants(q, k, v, scale) if alibi \
        else variants(q, k, v, cap, scale)

    def step(fn):
        def go():
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(do)
        return go
    rows = {}
    for name, fn in fns.items():
        q.grad = None
        out = fn(q, k, v)
        out.backward(do)
        rows[name] = dict(name=name, rounds=[], out_err=rel_err(out[:1].float(), ref),
                          dq_err=rel_err(q.grad[:1].float(), ref_in[0].grad))
    for _ in range(rounds):
        for name, fn in fns.items():
            rows[name]["rounds"].append(bench(step(fn))["ms"])
    pairs = S * (S + 1) / 2 if not window else sum(min(i + 1, window) for i in range(S))   # (i, j) computed
    flops = 4 * B * H * pairs * D * 3.5   # fwd (2 GEMMs) + bwd (5 GEMMs): 3.5x the forward
    for name, fn in fns.items():
        r = rows[name]
        r.update(ms=statistics.median(r["rounds"]), ms_min=min(r["rounds"]), ms_max=max(r["rounds"]),
                 gpu_ms=sum(kernel_ms(step(fn), calls=5).values()))
        r["tflops"] = flops / r["ms"] / 1e9
        print(f"B{B} H{H} S{S} D{D} {f'window {window}' if window else 'alibi' if alibi else f'cap {cap}'}: {name:26} {r['ms']:7.3f} ms [{r['ms_min']:.3f}-{r['ms_max']:.3f}] "
              f"gpu {r['gpu_ms']:7.3f} ms {r['tflops']:6.1f} TFLOP/s  out err {r['out_err']:.2e} "
              f"dq err {r['dq_err']:.2e}", flush=True)
    return dict(shape=[B, H, S, D], cap=cap, window=window, alibi=alibi, scale=scale, rows=list(rows.values()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cap", type=float, default=50.0)
    ap.add_argument("--kind", choices=("softcap", "window", "alibi"), default="softcap")
    args = ap.parse_args()
    out = []
    cases = {"softcap": CASES, "window": WINDOW_CASES, "alibi": ALIBI_CASES}[args.kind]
    for case in cases:
        out.append(run_case(*case[:4], args.cap, args.rounds, *case[4:5], alibi=args.kind == "alibi"))
        print("wrote", write(f"attention_{args.kind}", dict(cases=out)), flush=True)


if __name__ == "__main__":
    main()
