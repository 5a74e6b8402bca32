"""Offload, the recompute plan's third choice: a kept activation goes to host memory after its last
forward use and comes back before its first backward use, its copies beside the compute.

opsmath marks the nodes of its plan's offloaded segments (``meta["custom"][OFFLOAD]``, which AOTAutograd
copies onto every joint-graph node traced from them). After Inductor's partitioner has chosen what the
forward saves, ``offload_async.place`` sends the marked saved tensors to pinned host memory on a transfer
stream and brings them back ahead of their backward use (``offload_ops``), so the copies overlap the
compute. (Inductor's own offload copies on the compute stream, and torch 2.11's side-stream variant fails
or frees nothing before the forward's end: ``results/host_link-offload-*``.)

Cost model: a copy costs ``EXPOSED_SHARE * MODEL_SCALE * 2 b / link`` (``link``: this machine's host-link
bandwidth, measured once per process, ``host_link``; 55 GB/s each way on the H200 host, 51 on the H100's).
``MODEL_SCALE`` puts the copy's GPU seconds in the units of the recompute it replaces: ``segments``' model
prices recompute at 1.7-2.35x the GPU time it costs (LLaMA 1.1B at 0.25 on an H100: 38.6 modelled ms for
16.4 ms measured, ``results/recompute_overhead-llama-offload-price-h100-20261206.*``; 1.69x on the H200,
``op_times``). Priced in GPU seconds against modelled recompute, the default plan there offloaded 0.66 GiB,
recomputed 3.2 ms less and took 1.3 ms longer than recomputing alone. The share is measured:
HF LLaMA 1.1B at a quarter of its activations with 0.87 GiB offloaded (34 ms of copies out and back, 85%
of them under kernels, with ``offload_ops.PinnedBuffers`` and the queued reloads of ``offload_async``)
recomputed 6.6 ms less a step than the plan without offload and took 0.7 ms less: about a sixth of the
copy time showed, 0.2 with a margin (H100, ``results/recompute_overhead-llama-offload-h100-20261206.*``;
before those two, half showed). A copy is placed under compute only while the forward's compute after it
covers the queue of copies by ``MARGIN`` (``margin``; ``late``); one that cannot be is waited for at once
and priced at its whole time, and the plan solved again with that price (``plan_choice._late_priced``).

Only on the Inductor path (the CUDA default), on CUDA, and not under CUDA-graph replay (the host buffers
are outside the graph's pool); the op-by-op path plans without offload.
"""
from __future__ import annotations

import functools
import os
import time

import torch
import torch.fx as fx

from opsmath.memory import op_times

OFFLOAD = "opsmath_offload"   # meta["custom"] key of a node whose saved output the plan sends to the host
EXPOSED_SHARE = 0.2   # of a placed copy's out-and-back time, what the step measured of it (docstring)
MODEL_SCALE = 2.0     # the cost model's recompute seconds per GPU second (docstring)
MARGIN = 3.0          # modelled compute per copy second before a copy counts as placed under it


def margin() -> float:
    """``MARGIN``, or ``OPSMATH_OFFLOAD_MARGIN`` to compare other margins (read when a graph is planned and
    placed)."""
    return float(os.environ.get("OPSMATH_OFFLOAD_MARGIN", MARGIN))


def available(example_inputs, how: str) -> bool:
    """Offload applies: the graph runs on CUDA and goes to Inductor."""
    return how == "tag" and any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)


def step_cost(nbytes: int, link: float, exposed: float | None = None) -> float:
    """Modelled seconds an offload of ``nbytes`` adds: ``exposed`` of the copies' out-and-back time
    (``EXPOSED_SHARE`` where the forward's compute covers them, or ``OPSMATH_OFFLOAD_EXPOSED`` to compare
    other shares; 1 where it cannot: ``late``), in the units of the recompute it is weighed against: GPU
    seconds times ``MODEL_SCALE`` where the plan prices ops by ``segments``' model, GPU seconds where it
    measures them (``OPSMATH_MEASURED_COSTS=1``)."""
    if exposed is None:
        exposed = float(os.environ.get("OPSMATH_OFFLOAD_EXPOSED", EXPOSED_SHARE))
    scale = 1.0 if op_times.requested() else MODEL_SCALE
    return exposed * scale * 2 * nbytes / link


def late(segs, picked, link: float) -> list:
    """The picked offload steps (``"offload"``, ``"offload+casts"``, ``"recompute+offload"``) whose copies,
    queued one after another on the transfer stream from the end of their segments, would end after the
    forward's compute (the segments' modelled ``cost``) by ``margin()``: copies the forward cannot cover, which
    ``offload_async`` waits for at once (on the step's critical path)."""
    ends, t = [], 0.0
    for s in segs:
        t += s.cost
        ends.append(t)
    busy, out, m = 0.0, [], margin()
    for st in sorted((st for st in picked if st.sent), key=lambda st: st.j):
        busy = max(ends[st.j], busy) + m * st.sent / link
        if busy > t:
            out.append(st)
    return out


@functools.lru_cache(maxsize=None)
def host_link(device: str = "cuda", nbytes: int = 64 * 2**20, reps: int = 3) -> float:
    """Bytes per second of the slower direction between ``device`` and pinned host memory (Inductor's
    offload copies into pinned buffers of the caching host allocator, non-blocking on the compute
    stream): median of ``reps`` timed copies of ``nbytes`` after a warm-up."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for copy in (lambda: host.copy_(dev, non_blocking=True), lambda: dev.copy_(host, non_blocking=True)):
        copy()
        times = []
        for _ in range(reps):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            copy()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        rates.append(nbytes / sorted(times)[reps // 2])
    return min(rates)


def _mark(n: fx.Node) -> None:
    n.meta["custom"] = {**(n.meta.get("custom") or {}), OFFLOAD: True}


def mark_offloaded(order: list[fx.Node], segs, offloaded: dict[int, str]) -> None:
    """Mark what each offloaded segment keeps: all its nodes (``"kept"``: a kept segment sent to the host)
    or the producers of its external inputs (``"inputs"``: a recomputed segment whose boundary tensors go
    to the host)."""
    for i, kind in offloaded.items():
        nodes = order[segs[i].start:segs[i].end + 1]
        if kind == "kept":
            for n in nodes:
                _mark(n)
            continue
        inside = set(nodes)
        for n in nodes:
            for x in n.all_input_nodes:
                if x not in inside and x.op == "call_function":
                    _mark(x)


def link_for(example_inputs, how: str) -> float | None:
    """Host-link bytes/s when the plan may offload (``available``, and ``OPSMATH_OFFLOAD`` is not ``0``),
    else None."""
    if not available(example_inputs, how) or os.environ.get("OPSMATH_OFFLOAD") == "0":
        return None
    return host_link(str(next(t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda)))


def _marked(n: fx.Node) -> bool:
    return bool((n.meta.get("custom") or {}).get(OFFLOAD))


def has_offload(gm: fx.GraphModule) -> bool:
    return any(_marked(n) for n in gm.graph.nodes)
