"""Training-step memory under a budget (issue: recompute planning), one process, same data:
GPT-2-small (12x768, B8 T1024, bf16 autocast, dropout 0.1, attention written by hand) + AdamW, or with
``--model llama`` HF LLaMA 1.1B (``_models.llama_config``, SDPA, B4 T2048, fp32 weights, bf16 autocast).

Rows: eager; opsmath without a budget; opsmath with fractional budgets (0.75 / 0.5 / 0.25 of the
activations) and absolute budgets stepping down from the unconstrained peak until infeasible; per-block
``torch.utils.checkpoint``; ``torch.compile`` with ``activation_memory_budget`` 0.75 / 0.5 / 0.25. For each:
measured peak (``max_memory_allocated`` over a step after a warm-up step), predicted peak (opsmath),
median step time, overhead vs unconstrained opsmath. Then the longest sequence (B=1) whose step fits in
8 GiB, for eager, eager + SDPA, per-block checkpoint and opsmath with ``memory_budget="8GiB"``.

    python -m benchmarks memory            # on the GPU
    python -m benchmarks memory --smoke    # tiny, on CPU: checks the script, measures nothing
    python -m benchmarks memory --model llama --no-long   # the 1.1B budget sweep
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import opsmath
from opsmath.memory.plan import InfeasibleBudget
from benchmarks._models import build, build_llama


def measure(model_fn, batch, device, amp, steps=3, warmup=1):
    """(peak bytes over the timed steps after ``warmup`` steps or None on CPU, median step ms, model,
    exception or None, the peak of each phase: forward / backward / optimizer over the timed steps). A
    budget may be re-planned (and recompiled) at the second and third calls: its rows warm up for three
    steps so that the timed steps run the final plan."""
    phases = dict(forward=0, backward=0, optimizer=0)

    def mark(phase):   # the phase's peak, and a fresh statistic for the next one
        if device == "cuda":
            torch.cuda.synchronize()
            phases[phase] = max(phases[phase], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
    try:
        model = model_fn()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

        def step(timed=False):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
                loss = model(*batch)
            timed and mark("forward")
            loss.backward()
            timed and mark("backward")
            opt.step()
            opt.zero_grad(set_to_none=True)
            timed and mark("optimizer")
        for _ in range(warmup):   # capture, planning, optimizer state (and the re-plan)
            step()
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
        step(timed=True)   # once more, the peak taken apart by phase (synchronizing between them)
        return peak, statistics.median(times), model, None, phases
    except (torch.OutOfMemoryError, InfeasibleBudget) as e:
        e.__traceback__ = None   # its frames hold the failed step's model and tensors
        return None, None, None, e, phases
    finally:
        model = opt = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def plans(model) -> list:
    """Each captured graph's plan: the segments chosen for recompute, their modelled cost, the re-plan."""
    if model is None:
        return []
    return [{k: v for k, v in g.plan.to_dict().items() if k != "timeline"}
            for g in opsmath.report(model).graphs if g.plan is not None]


def predicted(model) -> int | None:
    plans = [g.plan for g in opsmath.report(model).graphs if g.plan is not None] if model is not None else []
    return max(p.predicted_peak for p in plans) if plans else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--paths", default="inductor,op-by-op",
                    help="opsmath paths the budget sweep runs: inductor (the CUDA default), op-by-op")
    ap.add_argument("--quick", action="store_true", help="fewer budgets and lengths (device time)")
    ap.add_argument("--long-only", action="store_true", help="only the longest sequence in 8 GiB")
    ap.add_argument("--no-long", action="store_true", help="the budget sweep without the longest sequence")
    ap.add_argument("--lengths", default="", help="comma-separated sequence lengths to try")
    ap.add_argument("--variants", default="", help="comma-separated longest-sequence variants (default all)")
    ap.add_argument("--fractions", default=None, help="fractional budgets of the sweep, comma-separated")
    ap.add_argument("--absolute", default=None, help="absolute budgets of the sweep as fractions of the "
                                                  "unconstrained peak, comma-separated")
    ap.add_argument("--gib", default="", help="absolute budgets in GiB, comma-separated (after the others)")
    ap.add_argument("--no-base", action="store_true", help="skip the unconstrained row (no overhead column)")
    ap.add_argument("--no-anchors", action="store_true", help="the sweep without its comparison rows")
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    args = ap.parse_args()
    if args.model == "llama" and not args.no_long:
        ap.error("--model llama runs the budget sweep only: add --no-long")
    args.variants = [v for v in args.variants.split(",") if v]
    args.fractions, args.absolute = (None if a is None else [float(x) for x in a.split(",") if x]
                                     for a in (args.fractions, args.absolute))   # "" runs none of them
    device = "cpu" if args.smoke else "cuda"
    if args.model == "llama":
        cfg = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256) if args.smoke else {}
        B, T, amp = (2, 64, False) if args.smoke else (4, 2048, True)
    elif args.smoke:
        cfg, B, T, amp = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1), 2, 64, False
    else:
        cfg, B, T, amp = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.1), 8, 1024, True
    args.make = (lambda variant: build_llama(cfg, device, variant)) if args.model == "llama" else \
        (lambda variant: build(cfg, device, variant))
    vocab = cfg.get("vocab_size", 32000)
    idx = torch.randint(0, vocab, (B, T), device=device)
    batch = (idx, torch.roll(idx, -1, 1))
    rows = []

    def row(name, fn, budget=None, base_ms=None):
        torch._dynamo.reset()
        peak, ms, model, err, phases = measure(fn, batch, device, amp, warmup=3 if budget is not None else 1)
        rows.append(dict(name=name, budget=None if budget is None else str(budget), peak=peak, ms=ms, base_ms=base_ms,
                         phase_peaks=phases,
                         predicted=predicted(model) if budget is not None else None,
                         plans=plans(model) if budget is not None else [],
                         error=None if err is None else f"{type(err).__name__}: {str(err)[:120]}"))
        r = rows[-1]
        gib = (lambda b: "-" if b is None else f"{b / 2**30:.2f}")
        print(f"{name:34} peak {gib(r['peak']):>6} GiB  predicted {gib(r['predicted']):>6}  "
              f"{'-' if ms is None else f'{ms:.1f}'} ms  {r['error'] or ''}"
              + "".join(f"  [activations {p['unconstrained'] / 2**30:.2f} GiB as {p['estimated_by']} saves them, "
                        f"kept {p['kept'] / max(1, p['unconstrained']):.3f}; "
                        f"expected peak {gib(p.get('expected_peak'))} GiB, target {gib(p.get('budget_bytes'))}, "
                        f"model error {gib(p.get('excess'))} (+ {gib(p.get('head_excess'))} at the forward's end)"
                        f"{', timeline' if p.get('timed') else ''}]" for p in r["plans"][:1])
              + (f"  phase peaks {' / '.join(f'{k} {gib(v)}' for k, v in phases.items())}" if peak else ""),
              flush=True)
        save({}, [])   # after every row: a run cut short keeps what it measured
        return r

    def save(longest, tried):
        if args.smoke:
            return None
        from benchmarks._harness import write
        name = "memory" + ("-llama" if args.model == "llama" else "") + ("-long" if args.long_only else "")
        for r in rows:
            if r["ms"] and r.get("base_ms"):
                r["overhead_vs_opsmath_unconstrained"] = r["ms"] / r["base_ms"] - 1
        return write(name, dict(rows=rows, longest_in_8GiB=longest, lengths_tried=tried, config=cfg, batch=[B, T]))

    if not args.long_only:
        sweep(args, cfg, device, batch, row)
    longest, tried = longest_in_8gib(args, cfg, device, amp) if not args.no_long else ({}, [])
    path = save(longest, tried)
    if path:
        print("wrote", path)


def sweep(args, cfg, device, batch, row):
    """Budgets from unconstrained down to infeasible on each opsmath path, then the anchors."""
    if not args.no_anchors:
        row("eager", lambda: args.make("eager"))
    for path in [p for p in args.paths.split(",") if p]:
        inductor = path == "inductor"
        tag = "opsmath" + (" + Inductor" if inductor else " op-by-op")
        ops = (lambda budget, i=inductor: opsmath.optimize(args.make("eager"), memory_budget=budget,
                                                           inductor=i))
        base = dict(ms=None, peak=None) if args.no_base else row(f"{tag} (no budget)", lambda: ops(None))
        for f in args.fractions if args.fractions is not None else ((0.5, 0.25) if args.quick else (0.75, 0.5, 0.25)):
            row(f"{tag} budget {f}", lambda f=f: ops(f), f, base["ms"])
        if base["peak"] is not None:
            for frac in args.absolute if args.absolute is not None else (
                    (0.75, 0.6) if args.quick else (0.85, 0.75, 0.65, 0.55)):
                b = int(base["peak"] * frac)
                r = row(f"{tag} budget {b / 2**30:.2f} GiB", lambda b=b: ops(b), b, base["ms"])
                if r["error"]:
                    break
        for gib in [float(x) for x in args.gib.split(",") if x]:
            row(f"{tag} budget {gib:.2f} GiB", lambda b=int(gib * 2**30): ops(b), int(gib * 2**30), base["ms"])
    if args.no_anchors:
        return
    row("per-block checkpoint", lambda: args.make("per_block_checkpoint"))
    for f in ((0.5, 0.25) if args.quick else (0.75, 0.5, 0.25)):
        def compiled(f=f):
            torch._functorch.config.activation_memory_budget = f
            return torch.compile(args.make("eager"))
        row(f"torch.compile activation_memory_budget {f}", compiled)
    torch._functorch.config.activation_memory_budget = 1.0


def longest_in_8gib(args, cfg, device, amp):
    """Longest T (B=1) whose step's measured peak stays within 8 GiB, per variant. Every variant shares
    one bool causal mask (``build(shared_mask=True)``): nanoGPT's per-layer fp32 masks alone exceed 8 GiB
    past T 12k. Anchors go up from the shortest length until one fails; opsmath goes down from the longest
    until one fits (each of its tries captures and compiles, ~1 min). The shared mask is itself T^2 bytes
    (4 GiB at T 65536), resident through the step; the SDPA-written model has none, and opsmath rewrites
    it too ("opsmath 8GiB SDPA-model")."""
    longest, tried = {}, []   # every length tried, with its peak or why it failed
    lengths = [int(x) for x in args.lengths.split(",") if x] or (
        [128, 256] if args.smoke else [2048, 4096, 8192, 16384, 24576, 32768])
    for name, variant, budget, inductor in (
            ("eager", "eager", None, None), ("eager + SDPA", "sdpa", None, None),
            ("per-block checkpoint", "per_block_checkpoint", None, None),
            ("opsmath 8GiB", "eager", "8GiB", None), ("opsmath 8GiB SDPA-model", "sdpa", "8GiB", None),
            ("opsmath 8GiB SDPA-model no-offload", "sdpa", "8GiB", None),
            ("opsmath 8GiB op-by-op", "eager", "8GiB", False)):
        if (args.quick and name == "opsmath 8GiB op-by-op") or (args.variants and name not in args.variants):
            continue
        for L in (sorted(lengths, reverse=True) if budget else lengths):
            c = dict(cfg, block_size=L)
            tok = torch.randint(0, cfg["vocab_size"], (1, L), device=device)
            torch._dynamo.reset()

            def fn(c=c, variant=variant, budget=budget, inductor=inductor):
                m = build(c, device, variant, shared_mask=True)
                return opsmath.optimize(m, memory_budget=budget, inductor=inductor) if budget else m
            t0 = time.perf_counter()
            link_for = opsmath.memory.offload.link_for
            if name.endswith("no-offload"):   # the plan without its third choice
                opsmath.memory.offload.link_for = lambda inputs, how: None
            try:
                peak, ms, model, err, _ = measure(fn, (tok, torch.roll(tok, -1, 1)), device, amp, steps=1,
                                               warmup=3 if budget else 1)
            finally:
                opsmath.memory.offload.link_for = link_for
            fits = err is None and (peak is None or peak <= 8 * 2**30)
            tried.append(dict(variant=name, length=L, peak=peak, ms=ms, predicted=predicted(model) if budget else None,
                              plans=plans(model) if budget else [],
                              wall_s=time.perf_counter() - t0,
                              error=None if err is None else f"{type(err).__name__}: {str(err)[:200]}"))
            model = None   # not alive while the next length is measured
            print(f"  {name} T={L}: peak {'-' if peak is None else f'{peak / 2**30:.2f} GiB'} "
                  f"{'-' if ms is None else f'{ms:.0f} ms'} {tried[-1]['error'] or ''}", flush=True)
            if fits:
                longest[name] = max(L, longest.get(name, 0))
            if fits == bool(budget):   # anchors stop at the first failure, opsmath at the first fit
                break
        print(f"longest sequence in 8 GiB, {name}: {longest.get(name)}", flush=True)
    return longest, tried


if __name__ == "__main__":
    main()
