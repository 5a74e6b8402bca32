"""Does opsmath's attention kernel lose time on the layouts models hand it? fwd+bwd of
``opsmath::attention`` (causal, BLOOM's ALiBi as a per-key bias, bf16) on contiguous (B, H, S, D) q/k/v
against q/k/v sliced out of one fused QKV projection, as BLOOM and GPT-NeoX write it ((B, S, H, 3, D)
viewed per head: each row of D contiguous, rows 3 H D apart), and the ALiBi bias as BLOOM holds it
((B*H, 1, S) viewed as (B, H, 1, S)). Kernel time from torch.profiler; 3 interleaved rounds.

    python benchmarks/attention_layout.py
"""
import statistics

import torch

from _harness import bench, write
from opsmath.kernels.attention import attention_op


def main(B=4, H=16, S=2048, D=128, rounds=3):
    torch.manual_seed(0)
    seed = torch.tensor(0, device="cuda")
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda") / H)
    bias = (slopes[:, None] * torch.arange(S, device="cuda")).to(torch.bfloat16).repeat(B, 1)[:, None]   # (B*H, 1, S)
    fused = torch.randn(B, S, H, 3, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flat = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)

    def run(q, k, v, copy=False):
        def go():   # the gradients of q, k, v themselves (no copy into the fused tensor's gradient)
            qkv = [t.contiguous() for t in (q, k, v)] if copy else (q, k, v)
            out = attention_op(*qkv, bias.view(B, H, 1, S), None, float("-inf"), True, D ** -0.5, 0.0, seed)[0]
            torch.autograd.grad(out, (q, k, v), do)
        return go
    per_head = [fused[..., i, :].transpose(1, 2) for i in range(3)]   # (B, H, S, D) views, strides (S*H*3*D, 3*D, H*3*D, 1)
    cases = {"contiguous q/k/v": run(*flat), "fused-QKV views (BLOOM, NeoX)": run(*per_head),
             # the views copied to contiguous (B, H, S, D) first: what a copy would buy
             "fused-QKV views, copied first": run(*per_head, copy=True)}
    rows = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            rows[name].append(bench(fn, device=True))
    out = []
    for name, rs in rows.items():
        ms, gpu = statistics.median(r["ms"] for r in rs), statistics.median(r["gpu_ms"] for r in rs)
        print(f"B{B} H{H} S{S} D{D} causal+alibi: {name:30} {ms:.3f} ms  gpu {gpu:.3f} ms", flush=True)
        out.append(dict(name=name, ms=ms, gpu_ms=gpu, rounds=rs))
    write("attention_layout", dict(shape=[B, H, S, D], rows=out))


if __name__ == "__main__":
    main()
