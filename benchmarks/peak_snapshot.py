"""What is alive at a training step's peak: one fleet model's step under each variant, recorded with CUDA's
allocator history, and the largest allocations live at the step's peak with the frames that made them.

For a row whose step peak differs from ``torch.compile``'s (the fleet's Mixtral at width 2, AMP: 1.060x), the
two variants' live sets side by side say which tensor the difference is. Each variant runs two steps
untraced (capture, compile, tuning), then one step under ``torch.cuda.memory._record_memory_history``.

    python -m benchmarks peak_snapshot --model mixtral --recipe amp --width 2 [--top 12]
"""
from __future__ import annotations

import argparse
import gc

import torch

from benchmarks._harness import write
from benchmarks.fleet import VARIANTS, FleetVariant, build, inputs

# frames worth naming: the model's, opsmath's, and Inductor's generated code (torch's own are left out)
KEEP = ("transformers/", "opsmath/", "torchinductor", "benchmarks/")


def peak_live(trace: list, top: int = 12) -> dict:
    """From an allocator trace (``_snapshot()["device_traces"][i]``: dicts with ``action``, ``addr``, ``size``,
    ``frames``), the bytes allocated at the highest point (above the trace's start) and the ``top`` largest
    allocations live there, each ``{"mib", "frames"}``. ``alloc`` adds a block, ``free_completed`` (the block
    back in the allocator's pool) removes it; a free of a block allocated before the trace is ignored."""
    _, best, at = _replay(trace, len(trace))
    at_best = _replay(trace, at + 1)[0]   # a second pass up to the peak: no copy of the live set at every new high
    biggest = sorted(at_best.values(), key=lambda e: -e["size"])[:top]
    return dict(peak_mib=best / 2**20, live=[dict(mib=round(e["size"] / 2**20, 2), frames=_named(e.get("frames", [])))
                                             for e in biggest])


def _replay(trace: list, stop: int) -> tuple[dict, int, int]:
    """The blocks live after ``trace[:stop]`` ({addr: event}), the highest total reached and its event's index."""
    live, total, best, at = {}, 0, 0, -1
    for i, ev in enumerate(trace[:stop]):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > best:
                best, at = total, i
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    return live, best, at


def _named(frames: list) -> list:
    return [f"{'/'.join(f['filename'].rsplit('/', 2)[-2:])}:{f['line']} {f['name']}" for f in frames
            if any(k in f.get("filename", "") for k in KEEP)][:4]


def traced_step(v: FleetVariant) -> dict:
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=400_000)
    try:
        v.step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return peak_live(snap["device_traces"][torch.cuda.current_device()])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mixtral")
    ap.add_argument("--recipe", default="amp")
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--variants", default="torch.compile,opsmath.optimize")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    rows = []
    for label in args.variants.split(","):
        torch._dynamo.reset()
        model = build(args.model, args.recipe, "cuda", False, args.width)
        batch, _ = inputs(args.model, model, "cuda", False)
        v = FleetVariant(label, VARIANTS[label](model), batch, "cuda", args.recipe)
        v.warm_up()
        v.step()
        row = dict(variant=label, **traced_step(v))
        rows.append(row)
        print(f"{label}: peak {row['peak_mib']:.1f} MiB above the step's start", flush=True)
        for e in row["live"]:
            print(f"  {e['mib']:9.2f} MiB  {' <- '.join(e['frames'][:3])}", flush=True)
        del v, model
        gc.collect()
        torch.cuda.empty_cache()
    print("wrote", write(f"peak_snapshot-{args.model}-{args.recipe}-width{args.width}", dict(args=vars(args), rows=rows)))


if __name__ == "__main__":
    main()
