"""Training-step memory under a budget (issue: recompute planning), one process, same data:
GPT-2-small (12x768, B8 T1024, bf16 autocast, dropout 0.1, attention written by hand) + AdamW.

Rows: eager; opsmath without a budget; opsmath with fractional budgets (0.75 / 0.5 / 0.25 of the
activations) and absolute budgets stepping down from the unconstrained peak until infeasible; per-block
``torch.utils.checkpoint``; ``torch.compile`` with ``activation_memory_budget`` 0.75 / 0.5 / 0.25. For each:
measured peak (``max_memory_allocated`` over a step after a warm-up step), predicted peak (opsmath),
median step time, overhead vs unconstrained opsmath. Then the longest sequence (B=1) whose step fits in
8 GiB, for eager, eager + SDPA, per-block checkpoint and opsmath with ``memory_budget="8GiB"``.

    python benchmarks/memory.py            # on the GPU
    python benchmarks/memory.py --smoke    # tiny, on CPU: checks the script, measures nothing
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import opsmath
from opsmath.plan import InfeasibleBudget
from _models import build


def measure(model_fn, batch, device, amp, steps=3):
    """(peak bytes over a step after warm-up or None on CPU, median step ms, exception or None)."""
    try:
        model = model_fn()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

        def step():
            with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
                loss = model(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step()  # warm-up: capture, planning, optimizer state
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        return peak, statistics.median(times), model, None
    except (torch.OutOfMemoryError, InfeasibleBudget) as e:
        return None, None, None, e
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def predicted(model) -> int | None:
    plans = [g.plan for g in opsmath.report(model).graphs if g.plan is not None] if model is not None else []
    return max(p.predicted_peak for p in plans) if plans else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--inductor-rows", default="none,0.5",
                    help="budgets also run with Inductor (the CUDA default; each row compiles for ~40 s)")
    ap.add_argument("--quick", action="store_true", help="fewer budgets and lengths (device time)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        cfg, B, T, amp = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1), 2, 64, False
    else:
        cfg, B, T, amp = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.1), 8, 1024, True
    idx = torch.randint(0, cfg["vocab_size"], (B, T), device=device)
    batch = (idx, torch.roll(idx, -1, 1))
    rows = []

    def row(name, fn, budget=None):
        torch._dynamo.reset()
        peak, ms, model, err = measure(fn, batch, device, amp)
        rows.append(dict(name=name, budget=None if budget is None else str(budget), peak=peak, ms=ms,
                         predicted=predicted(model) if budget is not None else None,
                         error=None if err is None else f"{type(err).__name__}: {str(err)[:120]}"))
        r = rows[-1]
        gib = (lambda b: "-" if b is None else f"{b / 2**30:.2f}")
        print(f"{name:34} peak {gib(r['peak']):>6} GiB  predicted {gib(r['predicted']):>6}  "
              f"{'-' if ms is None else f'{ms:.1f}'} ms  {r['error'] or ''}", flush=True)
        return r

    row("eager", lambda: build(cfg, device, "eager"))
    # The sweep runs the rewritten graph op by op (inductor=False): the plan's own checkpoints, whose
    # predicted peak is what the planner promises; a few budgets also run under Inductor.
    ops = (lambda budget: opsmath.optimize(build(cfg, device, "eager"), memory_budget=budget, inductor=False))
    base = row("opsmath (no budget)", lambda: ops(None))
    for f in (0.75, 0.5, 0.25):
        row(f"opsmath budget {f}", lambda f=f: ops(f), f)
    if base["peak"] is not None:
        for frac in ((0.65, 0.5) if args.quick else (0.8, 0.65, 0.5, 0.4)):
            b = int(base["peak"] * frac)
            r = row(f"opsmath budget {b / 2**30:.2f} GiB", lambda b=b: ops(b), b)
            if r["error"]:
                break
    for spec in [s for s in args.inductor_rows.split(",") if s]:
        budget = None if spec == "none" else float(spec)
        row(f"opsmath + Inductor budget {spec}", lambda b=budget: opsmath.optimize(
            build(cfg, device, "eager"), memory_budget=b, inductor=True), budget)
    row("per-block checkpoint", lambda: build(cfg, device, "per_block_checkpoint"))
    for f in ((0.5,) if args.quick else (0.75, 0.5, 0.25)):
        def compiled(f=f):
            torch._functorch.config.activation_memory_budget = f
            return torch.compile(build(cfg, device, "eager"))
        row(f"torch.compile activation_memory_budget {f}", compiled)
    torch._functorch.config.activation_memory_budget = 1.0
    for r in rows:
        if base["ms"] and r["ms"]:
            r["overhead_vs_opsmath_unconstrained"] = r["ms"] / base["ms"] - 1

    longest, tried = {}, []   # every length tried, with its peak or why it failed
    lengths = (128, 256) if args.smoke else ((2048, 4096, 8192, 16384, 24576) if args.quick else (2048, 4096, 8192, 16384, 24576, 32768))
    for name, variant, budget in (("eager", "eager", None), ("eager + SDPA", "sdpa", None),
                                  ("per-block checkpoint", "per_block_checkpoint", None),
                                  ("opsmath 8GiB", "eager", "8GiB")):
        for L in lengths:
            c = dict(cfg, block_size=L)
            tok = torch.randint(0, cfg["vocab_size"], (1, L), device=device)
            torch._dynamo.reset()

            def fn(c=c, variant=variant, budget=budget):
                m = build(c, device, variant)
                return opsmath.optimize(m, memory_budget=budget, inductor=False) if budget else m
            peak, ms, model, err = measure(fn, (tok, torch.roll(tok, -1, 1)), device, amp, steps=1)
            tried.append(dict(variant=name, length=L, peak=peak, ms=ms, predicted=predicted(model) if budget else None,
                              error=None if err is None else f"{type(err).__name__}: {str(err)[:200]}"))
            print(f"  {name} T={L}: peak {'-' if peak is None else f'{peak / 2**30:.2f} GiB'} "
                  f"{tried[-1]['error'] or ''}", flush=True)
            if err is not None or (peak is not None and peak > 8 * 2**30):
                break
            longest[name] = L
        print(f"longest sequence in 8 GiB, {name}: {longest.get(name)}", flush=True)

    if not args.smoke:
        from _harness import write
        print("wrote", write("memory", dict(rows=rows, longest_in_8GiB=longest, lengths_tried=tried, config=cfg, batch=[B, T])))


if __name__ == "__main__":
    main()
