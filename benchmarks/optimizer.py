"""AdamW step (with global-norm clipping) on GPT-2-small's parameter shapes (163M: vocab 50304, lm_head untied), H200:
opsmath.optim.AdamW (clip inside) vs torch foreach / fused AdamW, each with and without a separate
clip_grad_norm_. Floor = minimal bytes / copy bandwidth (4.13 TB/s): fp32 with clip reads grads twice
and reads+writes param, exp_avg, exp_avg_sq (32 B/param); bf16 master weights read bf16 grads twice,
read+write the fp32 master and moments and write the bf16 param (30 B/param).

    python benchmarks/optimizer.py
"""
from __future__ import annotations

import torch

from opsmath.optim import AdamW
from _harness import bench, rel_err, write

COPY_TBPS = 4.13
V, C, L, T = 50304, 768, 12, 1024  # nanoGPT's padded vocab: 163,109,376 params, as the anchor


def gpt2_small_shapes():
    shapes = [(V, C), (T, C)]
    for _ in range(L):
        shapes += [(C,), (C,), (C, 3 * C), (3 * C,), (C, C), (C,), (C,), (C,), (C, 4 * C), (4 * C,), (4 * C, C), (C,)]
    return shapes + [(C,), (C,), (V, C)]


def make(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).mul_(0.02).to(dtype)) for s in gpt2_small_shapes()]
    for p in ps:
        p.grad = torch.randn(p.shape, device="cuda", generator=g).mul_(0.01).to(dtype)
    return ps


def main():
    n = sum(torch.Size(s).numel() for s in gpt2_small_shapes())
    rows = []

    def run(name, dtype, opt_fn, clip, floor_bytes_per_param):
        ps = make(dtype)
        opt = opt_fn(ps)

        def step():
            if clip:
                torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
            opt.step()
        r = bench(step, warmup_ms=100, rep_ms=500)
        floor_ms = n * floor_bytes_per_param / COPY_TBPS / 1e9
        rows.append(dict(impl=name, dtype=str(dtype).replace("torch.", ""), params=n, ms=r["ms"],
                         floor_ms=floor_ms, x_floor=r["ms"] / floor_ms, peak_gib=r["peak_bytes"] / 2**30))
        print(f"{name:40} {r['ms']:7.3f} ms   floor {floor_ms:6.3f} ms   {r['ms'] / floor_ms:5.2f}x floor")
        ps = opt = None  # free before the next variant
        torch.cuda.empty_cache()

    f32 = torch.float32
    run("torch foreach + clip_grad_norm_", f32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True), True, 32)
    run("torch fused + clip_grad_norm_", f32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), True, 32)
    run("torch foreach (no clip)", f32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True), False, 28)
    run("torch fused (no clip)", f32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), False, 28)
    run("opsmath AdamW, clip inside", f32, lambda ps: AdamW(ps, lr=1e-4, max_grad_norm=1.0), False, 32)
    run("opsmath AdamW (no clip)", f32, lambda ps: AdamW(ps, lr=1e-4), False, 28)
    run("opsmath AdamW bf16 + fp32 master, clip", torch.bfloat16,
        lambda ps: AdamW(ps, lr=1e-4, max_grad_norm=1.0, master_weights=True), False, 30)

    # numerics: 3 steps of opsmath (clip inside) vs torch fused + clip_grad_norm_, same grads
    a, b = make(f32), make(f32)
    oa = AdamW(a, lr=1e-3, max_grad_norm=1.0)
    ob = torch.optim.AdamW(b, lr=1e-3, fused=True)
    for _ in range(3):
        oa.step()
        torch.nn.utils.clip_grad_norm_(b, 1.0)
        ob.step()
    err = max(rel_err(x.detach(), y.detach()) for x, y in zip(a, b))
    print(f"max relative difference of parameters after 3 steps vs torch fused + clip: {err:.2e}")
    path = write("optimizer", dict(rows=rows, params=n, numerics_max_rel_err=err))
    print("wrote", path)


if __name__ == "__main__":
    main()
