"""Training on a smaller card, emulated on a large one: ``torch.cuda.set_per_process_memory_fraction``
caps what the caching allocator may hold (reserved memory, fragmentation included) at the card's size,
and the model trains ``--steps`` steps under ``memory_budget`` = the card (or ``--budget``). **Recipe: AMP**
(fp32 weights, bf16 autocast). Per step: wall ms, the allocated and reserved memory after each phase
(forward, backward, optimizer) and the step's peaks, the allocator's retries (cache freed to make room) and out-of-memory
count; an out-of-memory or an infeasible budget ends the row, with the step it happened at. A row
without a card (``none``) runs first on the whole GPU: the unconstrained step the overhead is read
against (sequential rows: the cap is per process).

    python -m benchmarks card --model gpt2-long --cards 8GiB              # GPT-2-small, B1 T65536, SDPA
    python -m benchmarks card --model llama --cards none,16GiB,12GiB --optimizers torch,opsmath-8bit
    python -m benchmarks card --smoke                                     # CPU: checks the script

``--history N`` records the allocator's history through step N and writes the largest allocations alive
at its peak, grouped by the source line that made them (what the step holds beyond the plan's model).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

import opsmath
from opsmath.kernels.autotune import kernel_ms
from opsmath.memory.budget import InfeasibleBudget, parse_budget
from benchmarks._harness import smoke_out, write
from benchmarks._models import GPT2_SMALL, build, build_llama

OPTIMIZERS = {   # name: (params, device) -> optimizer
    "torch": lambda ps, dev: torch.optim.AdamW(ps, lr=1e-4, fused=dev == "cuda"),
    "opsmath": lambda ps, dev: opsmath.optim.AdamW(ps, lr=1e-4),
    "opsmath-8bit": lambda ps, dev: opsmath.optim.AdamW(ps, lr=1e-4, state_bits=8),
    "opsmath-in-backward": lambda ps, dev: opsmath.optim.AdamW(ps, lr=1e-4, in_backward=True),
    "opsmath-8bit-in-backward": lambda ps, dev: opsmath.optim.AdamW(ps, lr=1e-4, state_bits=8, in_backward=True),
}


def model_and_batch(name: str, device: str, smoke: bool):
    """(model, batch): ``gpt2-long`` GPT-2-small with SDPA at B1 T65536 (positions 65536, no mask
    buffers), ``llama`` HF LLaMA 1.1B at B4 T2048 (fp32 weights); tiny versions with ``smoke``."""
    torch.manual_seed(0)
    if name == "gpt2-long":
        cfg = dict(GPT2_SMALL, n_layer=2, n_embd=64, n_head=2, vocab_size=256) if smoke else dict(GPT2_SMALL)
        T = 256 if smoke else 65536
        model = build(dict(cfg, block_size=T), device, "sdpa", shared_mask=True)
        idx = torch.randint(0, cfg["vocab_size"], (1, T), device=device)
        return model, (idx, torch.roll(idx, -1, 1))
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=256) if smoke else {}
    B, T = (2, 64) if smoke else (4, 2048)
    model = build_llama(cfg, device, "eager")
    idx = torch.randint(0, model.lm.config.vocab_size, (B, T), device=device)
    return model, (idx, idx)


def cap(card: int | None, device: str) -> None:
    """The emulated card: the allocator may hold at most ``card`` bytes (the whole GPU for None)."""
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, card / total) if card else 1.0)


def memory(device: str) -> dict:
    if device != "cuda":
        return {}
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()   # read, never reset here: opsmath measures steps 1-2 on the same statistic
    return dict(allocated=s.get("allocated_bytes.all.current", 0), reserved=s.get("reserved_bytes.all.current", 0),
                peak_allocated=s.get("allocated_bytes.all.peak", 0), peak_reserved=s.get("reserved_bytes.all.peak", 0),
                retries=s.get("num_alloc_retries", 0), ooms=s.get("num_ooms", 0))


def peak_owners(snapshot: dict, top: int = 14) -> dict:
    """The allocations alive at the highest point of ``snapshot``'s trace, grouped by the innermost
    source line outside the allocator (opsmath, Inductor, transformers or the benchmark first)."""
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]
    live, total, best, at = {}, 0, 0, {}

    def label(frames):
        keys = ("opsmath", "_inductor", "transformers", "benchmarks", "_functorch", "triton")
        for f in frames:
            if any(k in f["filename"] for k in keys):
                return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
        return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            total += e["size"]
            if total > best:
                best, at = total, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    groups: dict = {}
    for size, frames in at.values():
        k = label(frames)
        groups[k] = groups.get(k, 0) + size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    return dict(peak=best, owners=[dict(where=k, bytes=v) for k, v in ranked])


def plans_of(model) -> list[dict]:
    """Each planned graph's plan (its timeline left out) and, for a block's graph under an in-backward
    optimizer, its share of the budget: ``(own, later, handed on, kept back for later floors)`` bytes."""
    from opsmath.meta_keys import BLOCK_SHARE
    if model is None or not hasattr(model, "_opsmath"):
        return []
    return [dict({k: v for k, v in g.plan.to_dict().items() if k != "timeline"},
                 block_share=list(g.source.meta.get(BLOCK_SHARE) or []) if g.source is not None else [])
            for g in opsmath.report(model).graphs if g.plan is not None]


def train(args, model_name: str, card: int | None, opt_name: str, device: str) -> dict:
    """One row: the model optimized under the card's budget, ``args.steps`` steps, each measured."""
    row = dict(model=model_name, card=card, optimizer=opt_name, steps=[], error=None)
    cap(card, device)
    budget = args.budget or card
    row["budget"] = budget
    model = opt = None
    try:
        model, batch = model_and_batch(model_name, device, args.smoke)
        model = opsmath.optimize(model, memory_budget=budget)
        opt = OPTIMIZERS[opt_name](model.parameters(), device)

        def step():
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(*batch)
            phases = dict(forward=memory(device))
            loss.backward()
            phases["backward"] = memory(device)
            opt.step()
            opt.zero_grad(set_to_none=True)
            phases["optimizer"] = memory(device)
            return loss, phases
        for i in range(args.steps):
            if device == "cuda":   # each step's peak apart (opsmath resets at the same point at steps 1-2)
                torch.cuda.reset_peak_memory_stats()
            if i + 1 == args.history and device == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=500000)
            t0 = time.perf_counter()
            loss, phases = step()
            if device == "cuda":
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            if i + 1 == args.history and device == "cuda":
                row["history_owners"] = peak_owners(torch.cuda.memory._snapshot())
                torch.cuda.memory._record_memory_history(enabled=None)
            peak = max((v.get("peak_allocated", 0) for v in phases.values()), default=0)
            held = max((v.get("peak_reserved", 0) for v in phases.values()), default=0)
            row["steps"].append(dict(step=i + 1, ms=ms, loss=loss.item(), peak=peak, peak_reserved=held, **phases))
            print(f"  {model_name} card={card} {opt_name} step {i + 1}: {ms:.1f} ms, peak {peak / 2**30:.2f} GiB, "
                  f"reserved {held / 2**30:.2f} GiB, retries {phases['optimizer'].get('retries', 0)}", flush=True)
        later = [s["ms"] for s in row["steps"][3:]] or [s["ms"] for s in row["steps"]]
        row["ms"] = statistics.median(later)
        if device == "cuda":
            def one():
                step()
            row["gpu_ms"] = sum(kernel_ms(one).values())
        if device == "cuda":   # whether the allocator's segments are expandable (opsmath turns them on)
            segs = torch.cuda.memory_snapshot()
            row["segments"] = dict(total=len(segs), expandable=sum(1 for g in segs if g.get("is_expandable")))
        row["plans"] = plans_of(model)
        row["report"] = str(opsmath.report(model))[-4000:]
    except (torch.OutOfMemoryError, InfeasibleBudget) as e:
        row["plans"] = plans_of(model)   # the graphs planned before it failed: what each kept, its share
        if args.history == len(row["steps"]) + 1 and device == "cuda":   # what the step held when it failed
            row["history_owners"] = peak_owners(torch.cuda.memory._snapshot())
        row["error"] = f"{type(e).__name__} at step {len(row['steps']) + 1}: {str(e)[:600]}"
        e.__traceback__ = None
        print(f"  {model_name} card={card} {opt_name}: {row['error']}", flush=True)
    finally:
        model = opt = None
        gc.collect()
        if device == "cuda":
            torch.cuda.memory._record_memory_history(enabled=None)
            row["max_reserved"] = max((s["peak_reserved"] for s in row["steps"]), default=None)
            row["max_peak"] = max((s["peak"] for s in row["steps"]), default=None)
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-long", choices=["gpt2-long", "llama"])
    ap.add_argument("--cards", default="8GiB", help="comma-separated card sizes; 'none' for the whole GPU")
    ap.add_argument("--budget", default=None, help="memory_budget (default: the card's size)")
    ap.add_argument("--optimizers", default="torch", help=f"comma-separated, of {sorted(OPTIMIZERS)}")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-expandable", action="store_true",
                    help="OPSMATH_EXPANDABLE_SEGMENTS=0: the allocator as it was (opsmath turns expandable segments on)")
    ap.add_argument("--history", type=int, default=0, help="what is alive at this step's peak (1: the first)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.steps = min(args.steps, 3)
        smoke_out("card")
    if args.no_expandable:
        os.environ["OPSMATH_EXPANDABLE_SEGMENTS"] = "0"
    cards = [None if c in ("none", "") else int(parse_budget(c)[1]) for c in args.cards.split(",")]
    rows = [train(args, args.model, card, o, device) for card in cards for o in args.optimizers.split(",")]
    name = f"card-{args.model}" + (f"-{args.tag}" if args.tag else "")
    path = write(name, dict(rows=rows, recipe="amp", expandable_segments=not args.no_expandable,
                            command="python -m benchmarks card " + " ".join(__import__("sys").argv[1:])))
    for r in rows:
        print(f"{r['model']} card {r['card']} {r['optimizer']}: {r.get('ms', '-')} ms, GPU {r.get('gpu_ms', '-')}, "
              f"max reserved {r.get('max_reserved')}, {r['error'] or 'ok'}")
    print(path)


if __name__ == "__main__":
    main()
