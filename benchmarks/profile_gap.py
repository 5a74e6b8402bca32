"""Where the time of one training step goes, variant against variant: GPU kernel time per step by kernel
name (torch.profiler), the host's wall time per step, and the kernels whose time differs most.

Variants are ``benchmarks/train.py``'s GPT-2-small ones (``--pair "torch.compile + SDPA,opsmath.optimize"``)
plus ``opsmath budget F`` (op by op, ``inductor=False``, memory_budget=F) and ``opsmath Inductor budget F``,
which is how the recompute overhead of a memory budget is taken apart.

    python -m benchmarks profile_gap --pair "opsmath op-by-op,opsmath budget 0.5"

More than two variants: each later one is compared with the first. A variant with a memory budget
also prints what its plan recomputes (the report's segment lines).
"""
from __future__ import annotations

import argparse
import time

import torch

import opsmath
from benchmarks._harness import kernel_ms
from benchmarks._models import GPT2_SMALL, build, gpt2_batch
from benchmarks.train import variants


def make(name):
    """(model factory, optimizer factory) for a variant name."""
    adamw = (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True))  # noqa: E731
    if name == "opsmath op-by-op":
        return (lambda: opsmath.optimize(build(GPT2_SMALL, "cuda", "eager"), inductor=False)), adamw
    for prefix, inductor in (("opsmath budget ", False), ("opsmath Inductor budget ", True)):
        if name.startswith(prefix):
            b = name[len(prefix):]
            budget = float(b) if b.replace(".", "").isdigit() and "." in b else b
            return (lambda: opsmath.optimize(build(GPT2_SMALL, "cuda", "eager"), memory_budget=budget,
                                             inductor=inductor)), adamw
    return variants("gpt")[name]


def kernels_per_step(name, batch, steps=3):
    """({kernel name: device ms per step}, host ms per step, peak GiB, [plan dicts])."""
    make_model, make_opt = make(name)
    torch._dynamo.reset()
    model = make_model()
    opt = make_opt(model)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    per = kernel_ms(step, steps)
    host = (time.perf_counter() - t0) * 1e3 / steps
    plans = [g.plan.to_dict() for g in opsmath.report(model).graphs if getattr(g, "plan", None) is not None] \
        if getattr(model, "_opsmath", None) is not None else []
    return per, host, torch.cuda.max_memory_allocated() / 2**30, plans


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="torch.compile + SDPA,opsmath.optimize")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--tag", default="", help="suffix of the results file (several pairs in one run)")
    args = ap.parse_args()
    batch = gpt2_batch()
    names = [s.strip() for s in args.pair.split(",")]
    res = {n: kernels_per_step(n, batch) for n in names}
    for n, (per, host, peak, plans) in res.items():
        print(f"\n== {n}: host {host:.2f} ms/step, GPU kernels {sum(per.values()):.2f} ms/step, "
              f"{len(per)} kernel names, peak {peak:.2f} GiB")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {v:8.3f} ms  {k[:110]}")
        for p in plans:
            print(f"  plan {p['budget']}: recompute {p['recompute_seconds'] * 1e3:.2f} ms modelled, "
                  f"{len(p['chosen'])} segments, selective {p['selective']}, offloaded {p['offloaded']}")
            for c in p["chosen"][:4]:
                print(f"    {c['ops']}  saved {c['saved'] / 2**20:.0f} MiB, cost {c['cost'] * 1e3:.3f} ms")
    a = res[names[0]][0]
    for other in names[1:]:
        b = res[other][0]
        print(f"\n== largest differences ({other} minus {names[0]}), ms per step")
        diff = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}
        for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
            print(f"  {v:+8.3f} ms  {k[:110]}")
    from benchmarks._harness import write
    print("wrote", write("profile_gap" + (f"-{args.tag}" if args.tag else ""), dict(
        variants={n: dict(host_ms=h, kernel_ms=sum(p.values()), peak_gib=pk, kernels=p, plans=pl)
                  for n, (p, h, pk, pl) in res.items()})))


if __name__ == "__main__":
    main()
