"""Measured op times for the recompute plan's costs (``segments.node_cost``), on the GPU the graph runs on.
Opt-in: ``OPSMATH_MEASURED_COSTS=1``; by default the plan prices ops by ``segments``' model.

The model in ``segments`` prices a recomputed op by its FLOPs or bytes at fixed rates plus 5 us a launch.
On the H200 that priced GPT-2-small's recompute at 1.9x the GPU time it cost. With measured costs, where
the graph's fake values are on a CUDA device, each forward op is run once more on random inputs of its
recorded shapes, strides and dtypes, and its GPU time stands in for the model's (``node.meta[MEASURED]``,
seconds):

* one measurement per distinct call (target, argument shapes, strides, dtypes, other arguments), kept
  for the process: a 22-block model measures each block's ops once;
* GPU time only: ``torch.cuda._sleep`` holds the stream while the host queues ``REPS`` calls between
  two events, so the host's dispatch (which a training step hides) is not counted;
* floats are random normal, integers 0 and booleans False (indices stay in range); the inputs are
  fresh tensors, never the model's; collectives, ops on symbolic sizes without a hint and ops that raise
  keep the model's cost. Measurement noise can change a plan between runs; the model cannot.

Why opt-in (H200, ``benchmarks/recompute_overhead.py --measured-costs``, BENCHMARKS.md): the measured
prediction is closer, but the plans are only level with the model's. Under Inductor a recomputed
elementwise op or reduction costs less than alone: it is fused into the backward's kernels, which read
its inputs where they would have read its output. Measured alone it looked dearer next to the GEMMs than
it is, and at ``memory_budget=0.25`` the unscaled plan recomputed two whole blocks of GPT-2-small (+15.7%
GPU time against +13.3% for the model's all-selective plan). ``annotate``'s ``scale`` therefore prices
what Inductor fuses at ``FUSED_SHARE`` of its measured time (the 0.5 plan's cheap ops measured 2.73 ms
alone and added 1.55 ms fused), GEMMs and fused ops at all of theirs. So priced: GPT-2-small +6.7% /
+14.8% wall at 0.5 / 0.25 (the model +6.9% / +14.9%), HF LLaMA 1.1B +13.9% at 0.5 (the model +15.0%),
with the recompute predicted within 5% on LLaMA (the model: 1.69x). Level within this host's noise,
so the model, which needs no timing at the first plan, stays the default.
"""
from __future__ import annotations

import operator
import os
import time
from typing import Callable, Optional

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import size_hint

MEASURED = "opsmath_measured_s"   # node.meta key: the op's measured GPU seconds per call
REPS = 10
FUSED_SHARE = 0.57   # a fused recompute's cost / the op's time alone (module docstring)
_SLEEP_CYCLES = 2_000_000         # ~1 ms at the H200's clock: longer than queuing REPS calls
_TIMES: dict[tuple, Optional[float]] = {}   # signature -> seconds (None: not measurable), this process
_SKIP_NAMESPACES = ("_c10d_functional", "c10d", "c10d_functional", "profiler")


def _desc(a) -> object:
    """A hashable description of one argument: tensors by shape, stride, dtype and storage size."""
    if isinstance(a, fx.Node):
        a = a.meta.get("val")
        if not isinstance(a, torch.Tensor):
            raise ValueError("an argument without a tensor value")
    if isinstance(a, torch.Tensor):
        return ("T", tuple(size_hint(s) for s in a.shape), tuple(size_hint(s) for s in a.stride()),
                size_hint(a.storage_offset()), a.dtype)
    if isinstance(a, (list, tuple)):
        return tuple(_desc(x) for x in a)
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise ValueError("a symbolic scalar")
    return repr(a)


def signature(n: fx.Node) -> Optional[tuple]:
    """``n``'s call as a hashable key, or None where it cannot be measured (not an op, a collective, a
    symbolic size without a hint)."""
    if n.op != "call_function" or n.target is operator.getitem or getattr(n.target, "is_view", False):
        return None
    if not isinstance(n.target, torch._ops.OpOverload) or n.target.namespace in _SKIP_NAMESPACES:
        return None
    try:
        return (str(n.target), _desc(list(n.args)), _desc(sorted(n.kwargs.items())))
    except (ValueError, TypeError, RuntimeError):
        return None


def _fresh(d, device) -> torch.Tensor:
    """A tensor matching a tensor's description ``d`` (``_desc``) with fresh contents."""
    _, shape, stride, offset, dtype = d
    extent = offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1 if all(shape) else 0
    flat = torch.empty(max(extent, 1), dtype=dtype, device=device)
    if dtype.is_floating_point or dtype.is_complex:
        flat.normal_()
    else:
        flat.zero_()
    return flat.as_strided(shape, stride, offset)


def _rebuild(arg, device):
    """``n.args`` with each node's value replaced by a fresh tensor of its description."""
    if isinstance(arg, fx.Node):
        return _fresh(_desc(arg), device)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_rebuild(a, device) for a in arg)
    return arg


def gpu_seconds(fn: Callable[[], object]) -> float:
    """GPU seconds per call of ``fn`` (CUDA): ``REPS`` calls queued behind a sleep, between two events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(_SLEEP_CYCLES)
    start.record()
    for _ in range(REPS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / REPS


def cpu_seconds(fn: Callable[[], object]) -> float:
    """Wall seconds per call of ``fn`` on the host: what ``annotate`` takes on CPU graphs in tests."""
    fn()
    t0 = time.perf_counter()
    for _ in range(REPS):
        fn()
    return (time.perf_counter() - t0) / REPS


def requested() -> bool:
    """``OPSMATH_MEASURED_COSTS=1``: the plan prices ops by their measured GPU time."""
    return os.environ.get("OPSMATH_MEASURED_COSTS", "0") == "1"


def annotate(order: list[fx.Node], timer: Optional[Callable] = None,
             scale: Optional[Callable[[fx.Node], float]] = None) -> int:
    """Measure the ops of ``order`` (the forward) on their fake values' device and record each one's time
    in ``node.meta[MEASURED]``; returns how many nodes got a time. Does nothing (0) unless the graph is on
    CUDA (or ``timer`` is given), while a CUDA graph is being captured, or unless ``OPSMATH_MEASURED_COSTS=1``
    (module docstring; with a ``timer`` the variable is not read). ``scale(node)``: the share of
    its measured time a recompute costs (``FUSED_SHARE`` for what Inductor fuses)."""
    device = next((n.meta["val"].device for n in order if isinstance(n.meta.get("val"), torch.Tensor)), None)
    if device is None or (timer is None and (not requested()
                                             or device.type != "cuda" or torch.cuda.is_current_stream_capturing())):
        return 0
    timer = timer or gpu_seconds
    done = 0
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for n in order:
            sig = signature(n)
            if sig is None:
                continue
            if sig not in _TIMES:
                _TIMES[sig] = _measure(n, device, timer)
            if _TIMES[sig] is not None:
                n.meta[MEASURED] = _TIMES[sig] * (scale(n) if scale else 1.0)
                done += 1
    return done


def _measure(n: fx.Node, device, timer) -> Optional[float]:
    try:
        args = _rebuild(n.args, device)
        kwargs = {k: _rebuild(v, device) for k, v in n.kwargs.items()}
        return float(timer(lambda: n.target(*args, **kwargs)))
    except Exception:  # noqa: BLE001  (an op that rejects random inputs keeps the model's cost)
        return None
