"""opsmath's attention kernel in every block configuration of a list, forward + backward, bf16, on one
shape: which tiles the tuner should have as candidates for a head dim (``src/opsmath/kernels/attention/configs.py``).

Per configuration ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, forced for the forward and both backward
kernels (``forced_config``): fwd+bwd and forward-only time (``do_bench`` median, ``--rounds`` rounds
interleaved over the configurations, median and spread), TFLOP/s, and the output's and dQ's relative
error against an fp32 reference on batch 0. A configuration that does not fit (Triton's out-of-resources
error) is reported and skipped. Per configuration also each kernel's own GPU time (torch.profiler: the
forward, the dQ and the dK/dV kernel), and per kernel the configuration that runs it fastest: the three
kernels are launched separately, so the best of each is what per-kernel tiles would reach. ``compiled eager`` (the same function under ``torch.compile``) is the row
to beat; ``SDPA`` the vendor kernel without the softcap (a floor, not the same function).

    python benchmarks/attention_config_sweep.py --shape 4,8,2048,256 --cap 50
"""
from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F

from _harness import bench, kernel_ms, rel_err, write
from opsmath.kernels.attention import attention_op
from opsmath.kernels.attention.configs import forced_config
from opsmath.kernels.attention.tuning import eager_same_dtype

SWEEP = [(64, 32, 8, 1), (32, 32, 4, 1), (64, 64, 8, 1), (64, 32, 8, 2), (64, 32, 4, 2), (64, 64, 8, 2),
         (128, 32, 8, 2), (128, 64, 8, 1), (128, 64, 8, 2), (32, 64, 4, 2), (128, 32, 8, 1), (64, 128, 8, 1),
         (64, 64, 4, 2), (128, 128, 8, 1), (32, 64, 4, 1), (32, 64, 8, 1), (64, 64, 4, 1), (128, 64, 4, 1),
         (64, 32, 4, 1), (32, 32, 4, 2)]
KERNELS = ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,8,2048,256", help="B,H,S,D")
    ap.add_argument("--cap", type=float, default=50.0, help="logit softcap (0: none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="", help="BM:BN:W:S,... (default: SWEEP)")
    args = ap.parse_args()
    B, H, S, D = (int(x) for x in args.shape.split(","))
    cap = args.cap
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",") if c] or SWEEP
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    scale = D ** -0.5 * (8 if cap else 1)
    ref_in = [t.detach().float()[:1].requires_grad_() for t in (q, k, v)]
    ref = eager_same_dtype(*ref_in, None, None, float("-inf"), True, scale, softcap=cap)
    ref.backward(do[:1].float())
    seed = torch.tensor(0, device="cuda")
    own = (lambda q, k, v: attention_op(q, k, v, None, None, float("-inf"), True, scale, 0.0, seed, cap)[0])
    eager = torch.compile(lambda q, k, v: eager_same_dtype(q, k, v, None, None, float("-inf"), True, scale,
                                                           softcap=cap))
    fns = {"compiled eager": (eager, None), "SDPA causal, no softcap": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale), None)}
    fns.update({f"opsmath {c}": (own, c) for c in configs})

    def run(fn, cfg, backward=True):
        def go():
            with forced_config(cfg) if cfg else contextlib.nullcontext():
                q.grad = k.grad = v.grad = None
                out = fn(q, k, v)
                if backward:
                    out.backward(do)
        return go
    rows = {}
    for name, (fn, cfg) in fns.items():
        try:
            run(fn, cfg)()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (a tile that does not fit: reported)
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        with forced_config(cfg) if cfg else contextlib.nullcontext():
            out = fn(q, k, v)
        rows[name] = dict(name=name, config=cfg, rounds=[], fwd=[], kernels=[], out_err=rel_err(out[:1].float(), ref),
                          dq_err=rel_err(q.grad[:1].float(), ref_in[0].grad))
    flops = 4 * B * H * S * (S + 1) / 2 * D * 3.5
    for _ in range(args.rounds):
        for name, r in rows.items():
            fn, cfg = fns[name]
            r["rounds"].append(bench(run(fn, cfg))["ms"])
            r["fwd"].append(bench(run(fn, cfg, backward=False))["ms"])
            if cfg:
                r["kernels"].append(kernel_ms(run(fn, cfg)))
    for r in rows.values():
        r.update(ms=statistics.median(r["rounds"]), ms_min=min(r["rounds"]), ms_max=max(r["rounds"]),
                 fwd_ms=statistics.median(r["fwd"]))
        r["tflops"] = flops / r["ms"] / 1e9
        print(f"B{B} H{H} S{S} D{D} cap {cap}: {r['name']:34} {r['ms']:7.3f} ms [{r['ms_min']:.3f}-{r['ms_max']:.3f}] "
              f"fwd {r['fwd_ms']:.3f} {r['tflops']:6.1f} TFLOP/s  out err {r['out_err']:.2e} dq err {r['dq_err']:.2e}",
              flush=True)
    best = {}
    for kname in KERNELS:   # each kernel's fastest configuration, by its median GPU time over the rounds
        times = {r["name"]: statistics.median(sum(v for n, v in kr.items() if kname in n) for kr in r["kernels"])
                 for r in rows.values() if r["kernels"]}
        for r in rows.values():
            if r["name"] in times:
                r.setdefault("kernel_ms", {})[kname] = times[r["name"]]
        if times:
            best[kname] = min(times, key=times.get)
            print(f"{kname:16} fastest: {best[kname]} {times[best[kname]]:.3f} ms; "
                  + ", ".join(f"{n.replace('opsmath ', '')} {t:.3f}" for n, t in sorted(times.items(), key=lambda x: x[1])[:6]),
                  flush=True)
    print("wrote", write("attention_config_sweep", dict(shape=[B, H, S, D], cap=cap, rows=list(rows.values()), fastest=best)))


if __name__ == "__main__":
    main()
