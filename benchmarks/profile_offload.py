"""Where an offloaded plan's step time goes: the compute stream's idle gaps, the copies' time and rate, how
much of the copies overlaps kernels, and where the host's enqueue time goes (syncs, the CUDA runtime calls and
ops with the most CPU self time: ``_harness.host_breakdown``). HF LLaMA 1.1B as ``recompute_overhead.py --model
llama``, no CUDA graphs, one torch.profiler trace of ``--steps`` steps per variant, one process.

A variant is ``BUDGET:EXPOSED[:MARGIN]``: the plan made with offload's copies priced at ``EXPOSED`` of their
time (``OPSMATH_OFFLOAD_EXPOSED``; ``none`` plans without offload), and planned and placed with
``OPSMATH_OFFLOAD_MARGIN`` at ``MARGIN``.

    python -m benchmarks profile_offload --variants 0.25:0.05,0.25:none
"""
from __future__ import annotations

import argparse
import json

import torch

from benchmarks._harness import host_breakdown, out_path, write
from benchmarks.recompute_overhead import Variant
from benchmarks._models import gpt2_batch
from opsmath.runtime import offload_async


def _intervals(events):
    return sorted((e.start_ns(), e.end_ns()) for e in events)


def _overlap(a, b) -> int:
    """ns of the intervals ``a`` covered by the union of ``b`` (both sorted)."""
    total, j = 0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            total += max(0, min(e, b[k][1]) - max(s, b[k][0]))
            k += 1
    return total


def trace(v: Variant, steps: int) -> dict:
    """Per stream: events, busy ms; the compute stream's gaps; copies: ms, GB/s, share under kernels."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            v.step()
        torch.cuda.synchronize()
    evs = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
    streams: dict = {}
    for e in evs:
        streams.setdefault(e.device_resource_id(), []).append(e)
    compute = max(streams, key=lambda s: sum(1 for e in streams[s] if not e.name().startswith("Memcpy")))
    ck = _intervals(streams[compute])
    gaps = sum(max(0, b[0] - a[1]) for a, b in zip(ck, ck[1:]))
    copies = [e for e in evs if e.name().startswith("Memcpy")]
    nbytes = 0
    for e in copies:
        try:
            nbytes += int(json.loads("{" + e.metadata_json() + "}").get("bytes", 0))
        except (ValueError, TypeError):
            pass
    copy_ns = sum(e.duration_ns() for e in copies)
    return dict(streams={str(s): dict(events=len(es), busy_ms=sum(e.duration_ns() for e in es) / 1e6 / steps)
                         for s, es in streams.items()},
                compute_gaps_ms=gaps / 1e6 / steps, copies=len(copies) // steps, copies_ms=copy_ns / 1e6 / steps,
                copy_gbps=nbytes / copy_ns if copy_ns and nbytes else None,   # None: the trace gave no byte counts
                copies_under_kernels=_overlap(_intervals(copies), ck) / max(1, copy_ns))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="0.25:0.05,0.25:none")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    batch = tuple(t.remainder(32000) for t in gpt2_batch(B=4, T=2048))
    torch._dynamo.reset()
    rows = []
    for spec in args.variants.split(","):
        budget, exposed, *margin = spec.split(":")
        env = {**({"OPSMATH_OFFLOAD_EXPOSED": exposed} if exposed != "none" else {}),
               **({"OPSMATH_OFFLOAD_MARGIN": margin[0]} if margin else {})}
        placed = len(offload_async.placements)
        v = Variant(spec, float(budget), False, batch, llama=True, offload=exposed != "none", env=env)
        v.timed_round(5)
        row = dict(variant=spec, wall_ms=v.wall[-1], host_ms=v.host[-1], step_peak_gib=v.step_peak_gib, **trace(v, args.steps))
        # the copies the forward cannot cover (waited for at once), by graph: what they are and where made
        row["late"] = [p.late_tensors for p in offload_async.placements[placed:]]
        row["host"] = host_breakdown(v.step, steps=args.steps,   # where the enqueue time goes: syncs, runtime calls
                                     trace=out_path(f"trace-offload-{spec.replace(':', '_')}.json.gz"))
        rows.append(row)
        print({k: val for k, val in row.items() if k != "host"}, flush=True)
        h = row["host"]
        print(f"  host: {h['syncs']:.0f} syncs a step {h['sync_sites'][:3]}; most CPU self time: "
              + ", ".join(f"{o['name']} {o['self_cpu_ms']:.2f} ms x{o['calls']:.0f}" for o in h["ops"][:8]), flush=True)
    print("wrote", write("profile_offload-llama", dict(rows=rows)))


if __name__ == "__main__":
    main()
