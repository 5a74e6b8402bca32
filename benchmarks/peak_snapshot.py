"""What is alive at a training step's peak: one fleet model's step under each variant, recorded with CUDA's
allocator history, and the largest allocations live at the step's peak with the frames that made them.

For a row whose step peak differs from ``torch.compile``'s (the fleet's Mixtral at width 2, AMP: 1.060x), the
two variants' live sets side by side say which tensor the difference is. Each variant runs two steps
untraced (capture, compile, tuning), then one step under ``torch.cuda.memory._record_memory_history``. A row
gives the bytes allocated at the step's start (``start_mib``), ``max_memory_allocated`` over the step
(``max_allocated_mib``), the highest point above the start (``peak_mib``), the largest allocations live there
(``live``) and the live bytes by the innermost named frame that allocated them (``by_site``); the same for the
highest point in the step's last 40% of events (``late``: late backward, where a variant that saves less for
backward peaks); and MiB allocated over the step (``timeline``). A variant is a fleet variant, or
``skip=FAMILY+FAMILY`` for ``opsmath.optimize`` without those rewrite families.

    python -m benchmarks peak_snapshot --model mixtral --recipe amp --width 2 [--top 12]
        [--variants torch.compile,opsmath.optimize,skip=experts]
"""
from __future__ import annotations

import argparse
import gc

import torch

from benchmarks._harness import write
from benchmarks.fleet import VARIANTS, FleetVariant, build, inputs

# frames worth naming: the model's, opsmath's, and Inductor's generated code (torch's own are left out)
KEEP = ("transformers/", "opsmath/", "torchinductor", "benchmarks/")
LATE = 0.6   # ``late``: the highest point in the trace's last 40% of events (late backward)


def peak_live(trace: list, top: int = 12, after: int = 0) -> dict:
    """From an allocator trace (``_snapshot()["device_traces"][i]``: dicts with ``action``, ``addr``, ``size``,
    ``frames``), the bytes allocated at the highest point (above the trace's start) and the ``top`` largest
    allocations live there, each ``{"mib", "frames"}``, and the live bytes by site (``by_site``); the replay
    is ``_walk``'s. ``after``: the highest point at or after that event (a late part of the step: two variants
    whose peaks fall at different moments compared at the same one)."""
    _, best, at = _replay(trace, len(trace), after)
    at_best = _replay(trace, at + 1)[0]   # a second pass up to the peak: no copy of the live set at every new high
    biggest = sorted(at_best.values(), key=lambda e: -e["size"])[:top]
    sites: dict = {}
    for e in at_best.values():   # live bytes by the innermost named frame: where two variants' sets differ
        site = (_named(e.get("frames", [])) or ["(torch)"])[0]
        sites[site] = sites.get(site, 0) + e["size"]
    by_site = sorted(sites.items(), key=lambda kv: -kv[1])[:2 * top]
    return dict(peak_mib=best / 2**20, live=[dict(mib=round(e["size"] / 2**20, 2), frames=_named(e.get("frames", [])))
                                             for e in biggest],
                by_site=[dict(site=k, mib=round(v / 2**20, 2)) for k, v in by_site])


def _walk(trace: list, stop: int):
    """Replay ``trace[:stop]``: per event, ``(index, event, live blocks {addr: event}, bytes live)``. ``alloc``
    adds a block, ``free_completed`` removes it; a free of a block allocated before the trace is ignored."""
    live, total = {}, 0
    for i, ev in enumerate(trace[:stop]):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
        yield i, ev, live, total


def _replay(trace: list, stop: int, after: int = 0) -> tuple[dict, int, int]:
    """The blocks live after ``trace[:stop]`` ({addr: event}), the highest total reached at or after event
    ``after`` and its event's index."""
    live, best, at = {}, 0, -1
    for i, ev, live, total in _walk(trace, stop):
        if ev["action"] == "alloc" and total > best and i >= after:
            best, at = total, i
    return live, best, at


def timeline(trace: list, points: int = 40) -> list:
    """MiB allocated above the trace's start at ``points`` evenly spaced events (the step's shape over time)."""
    every = max(1, len(trace) // points)
    return [round(total / 2**20, 1) for i, _, _, total in _walk(trace, len(trace)) if i % every == every - 1]


def _named(frames: list) -> list:
    return [f"{'/'.join(f['filename'].rsplit('/', 2)[-2:])}:{f['line']} {f['name']}" for f in frames
            if any(k in f.get("filename", "") for k in KEEP)][:4]


def traced_step(v: FleetVariant) -> dict:
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=400_000)
    try:
        v.step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    return dict(start_mib=start / 2**20, max_allocated_mib=torch.cuda.max_memory_allocated() / 2**20,
                timeline=timeline(trace), late=peak_live(trace, after=int(LATE * len(trace))), **peak_live(trace))


def _wrap(label: str):
    """A fleet variant, or ``skip=FAMILY+FAMILY``: ``opsmath.optimize`` without those rewrite families."""
    if label.startswith("skip="):
        import opsmath
        return lambda m: opsmath.optimize(m, skip=label[len("skip="):].split("+"))
    return VARIANTS[label]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mixtral")
    ap.add_argument("--recipe", default="amp")
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--variants", default="torch.compile,opsmath.optimize", help="fleet variants or skip=FAMILY+...")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    rows = []
    for label in args.variants.split(","):
        torch._dynamo.reset()
        model = build(args.model, args.recipe, "cuda", False, args.width)
        batch, _ = inputs(args.model, model, "cuda", False)
        v = FleetVariant(label, _wrap(label)(model), batch, "cuda", args.recipe)
        v.warm_up()
        v.step()
        row = dict(variant=label, **traced_step(v))
        rows.append(row)
        print(f"{label}: peak {row['peak_mib']:.1f} MiB above the step's start ({row['start_mib']:.1f} MiB; "
              f"max allocated {row['max_allocated_mib']:.1f} MiB)", flush=True)
        for e in row["live"]:
            print(f"  {e['mib']:9.2f} MiB  {' <- '.join(e['frames'][:3])}", flush=True)
        print("  by site:", flush=True)
        for e in row["by_site"]:
            print(f"  {e['mib']:9.2f} MiB  {e['site']}", flush=True)
        print(f"  MiB over the step: {row['timeline']}", flush=True)
        print(f"  late in the step: {row['late']['peak_mib']:.1f} MiB; by site:", flush=True)
        for e in row["late"]["by_site"]:
            print(f"  {e['mib']:9.2f} MiB  {e['site']}", flush=True)
        del v, model
        gc.collect()
        torch.cuda.empty_cache()
    print("wrote", write(f"peak_snapshot-{args.model}-{args.recipe}-width{args.width}", dict(args=vars(args), rows=rows)))


if __name__ == "__main__":
    main()
