"""Offload, the recompute plan's third choice: a kept activation goes to host memory after its last
forward use and comes back before its first backward use.

The copies are Inductor's own (``torch._functorch.config.enable_activation_offloading``): a forward node
marked ``should_offload`` whose output the partitioner saves gets a ``device_put`` to the CPU after its
last forward user, and the backward a ``device_put`` back before its first user. opsmath marks the nodes
of its plan's offloaded segments (``meta["custom"][OFFLOAD]``, which AOTAutograd copies onto every
joint-graph node traced from them) and a joint-graph pass turns the mark into ``should_offload``.

Cost model: those copies run on the compute stream (torch 2.11's side-stream variant,
``activation_offload_separate_stream``, fails in its fake-tensor kernel: ``results/host_link-offload-*``),
so a tensor of ``b`` bytes costs ``2 b / link`` seconds of step time, where ``link`` is this machine's
host-link bandwidth, measured once per process (``host_link``; 55 GB/s each way on the H200 host). The
plan weighs that against recompute: at short sequences recompute is cheaper; offload pays where a
segment's recompute is long (attention at long sequences) or where recompute alone cannot reach the
budget (the tensors a recomputed block still keeps at its boundary).

Only on the Inductor path (the CUDA default) and on CUDA; the op-by-op path plans without offload.
"""
from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.fx as fx

OFFLOAD = "opsmath_offload"   # meta["custom"] key of a node whose saved output the plan sends to the host


def available(example_inputs, how: str) -> bool:
    """Offload applies: the graph runs on CUDA, goes to Inductor, and this torch's partitioner offloads."""
    return (how == "tag" and hasattr(torch._functorch.config, "enable_activation_offloading")
            and any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs))


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
    """Host-link bytes/s when the plan may offload (``available``), else None."""
    if not available(example_inputs, how):
        return None
    return host_link(str(next(t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda)))


def _marked(n: fx.Node) -> bool:
    return bool((n.meta.get("custom") or {}).get(OFFLOAD))


def has_offload(gm: fx.GraphModule) -> bool:
    return any(_marked(n) for n in gm.graph.nodes)


def should_offload(graph: fx.Graph) -> None:
    """Joint-graph pass: nodes traced from a marked node become ``should_offload`` (the partitioner then
    offloads those among them it saves; views and non-contiguous tensors it keeps on the device)."""
    for n in graph.nodes:
        if _marked(n):
            n.meta["should_offload"] = True


def offloading(gm: fx.GraphModule):
    """(context, joint-graph pass) to compile ``gm`` with: Inductor's offload switched on and the marking
    pass, when ``gm`` has offloaded nodes; else (a null context, None)."""
    if not has_offload(gm):
        return contextlib.nullcontext(), None
    return torch._functorch.config.patch(enable_activation_offloading=True), should_offload
