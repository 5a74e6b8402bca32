"""Recompute planning: keep a training step's predicted memory under a budget at the least recompute time.

1. **Liveness** (fake tensors, no real memory): the captured graph runs once under
   ``saved_tensors_hooks`` inside an ``fx.Interpreter`` that knows which node is running, so every
   byte autograd saves is attributed to the node that saved it (deduplicated by storage; graph
   inputs: parameters, buffers, user inputs are not activations).
2. **Segments** and **cost** (``opsmath.memory.segments``): candidate segments cut at opsmath's points (the
   fewest activations crossing, at two granularities) and, where the model checkpoints its own layers,
   the user's regions; a modelled recompute time per segment.
3. **Choice**: one exact 0/1 knapsack (``plan_solve``: a DP over positions and savings in 1/4096 steps
   of the total, savings rounded down so the budget holds, NumPy rows), minimizing modelled cost; a
   recomputed segment is taken only where its backward fits:
   the bytes the segments up to it keep plus its own activations (later segments' are freed by then,
   so an early segment may be recomputed under a budget that a late one would break); solved for each
   segmentation, the cheaper kept (ties: the user's). A run may also be recomputed selectively: its
   GEMMs and fused GEMM ops kept, only its cheap ops (norms, activations, dropout, casts) recomputed,
   freeing what those produced (``selective.selective``), or its plain GEMMs recomputed too and only its
   fused ops (attention) kept; under Inductor also only the cheap ops computable from what is kept anyway
   (``"selective-free"``: an activation product from its saved GEMM outputs, at no kept cost), and a
   segment's weights' low-precision copies (autocast's, ``weight_casts``) recomputed instead of saved,
   alone or beside a selective run (``OPSMATH_CHEAP_STEPS=0`` plans without these two); and, nested
   in a run, one saved tensor's producer at a time with what it needs (``"selective-tensors"``,
   ``selective.finer``; ``OPSMATH_TENSOR_STEPS=0`` plans without them). On CUDA under
   Inductor a segment may instead send what it keeps to host
   memory (``offload.py``: kept, or recomputed with its inputs on the host), at the modelled cost of
   the copies over this machine's measured host link.
4. **Emission** (``plan_emit``): each chosen segment becomes a sub-GraphModule called through
   ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (RNG state preserved, so dropout
   masks, opsmath's seeds included, are the same in the recompute). When the graph goes on to
   Inductor, the segment's nodes are tagged ``MUST_RECOMPUTE`` instead (``tag_recompute``; what a
   selective run keeps ``MUST_SAVE``), and the offloaded ones marked for Inductor's offload (``offload``).

Predicted peak, for a fraction = resident (parameters, their gradients, optimizer state, inputs) + the
activations' peak: all kept bytes (the start of backward), or, while a recomputed segment's backward
runs, what the segments up to it keep plus its activations (``plan_solve._peak``); a fraction f bounds
that peak by f of the activations, and the loss's workspace at the end of the forward (declared, then
measured) comes beside it, at any fraction: fraction 1 recomputes nothing. For a byte budget the
gradients are counted when backward allocates them, as the activations they follow are freed
(``Plan.timeline``): the same points, each with the gradients allocated by then. On HF LLaMA 1.1B with
fp32 master weights (3.5 GB of gradients, 11.5 GB of activations) counting them all from the start put
the model 2.9 GB above the step's real peak, which sits at the end of the forward.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch.fx as fx

from opsmath.memory import offload, op_times, weight_casts
from opsmath.memory import plan_chart
from opsmath.memory.budget import STEP_SLACK, InfeasibleBudget, _size, check_step_share, parse_budget, step_peak  # (re-exported)
from opsmath.memory.plan_emit import emit_checkpoints, tag_recompute
from opsmath.memory.plan_choice import SELECTIVE_RUNS, best_option, choose, grads_by_segment, merged  # noqa: F401
from opsmath.memory.segments import (Segment, describe, forward_order, is_compute, node_workspace, pinned_positions,
                                     segments_of, user_regions, user_segments)
from opsmath.memory.selective import TENSORS, saved_index

@dataclass
class Plan:
    budget: object
    resident: int
    unconstrained: int          # activation bytes saved without recompute
    kept: int                   # activation bytes saved with this plan
    transient: int              # bytes above ``kept`` at the activations' peak (a recompute's, back)
    predicted_peak: int
    segments: list[Segment]
    chosen: list[int] = field(default_factory=list)
    recompute_seconds: float = 0.0
    planning_seconds: float = 0.0
    measured_peak: int | None = None
    replanned: str = ""         # why the plan was re-made at the graph's second call, if it was
    segmentation: str = "opsmath"   # whose cut points: "opsmath", "opsmath-fine" (half-blocks) or "user"
    user_regions: int = 0       # the user's checkpoint regions handed to the plan
    note: str = ""              # how a fractional budget was met across graphs, if this graph needed it
    offloaded: dict = field(default_factory=dict)   # segment index -> "kept" | "inputs" (offload.py)
    selective: list[int] = field(default_factory=list)   # segments whose cheap ops only are recomputed
    gemms_recomputed: list[int] = field(default_factory=list)   # selective ones recomputing GEMMs too
    casts: list[int] = field(default_factory=list)   # segments whose parameters' copies recompute (weight_casts)
    tensors: list[int] = field(default_factory=list)   # selective ones recomputing chosen GEMMs ("selective-tensors")
    link: float | None = None   # host-link bytes/s the plan could offload over (None: no offload)
    ops: dict = field(default_factory=dict)   # segment index -> what it spans (segments.describe)
    grads: list = field(default_factory=list)   # per segment: gradient bytes its backward allocates
    expected_peak: int | None = None   # the timeline's maximum with ``grads`` (predicted_peak: the bound)
    estimated_by: str = "eager autograd"   # who saves the bytes counted, or "Inductor's partition"
    excess: int = 0             # measured peak above the model's (replan.py), counted in the predicted peak
    timed: bool = False         # planned against the gradients' timing: predicted_peak is the timeline's
    head_excess: int = 0        # measured bytes at the end of the forward alone, beyond ``excess`` (replan.py)
    modelled: tuple = (0, 0)    # the model's peak at the end of the forward and over the step, no error added
    share: float | None = None  # a fraction's share for this graph, where the step's other graphs moved it
    measured_ops: int = 0       # forward ops whose recompute cost is their time measured on the GPU
    to_come: int = 0            # optimizer state in ``resident`` that the first step does not hold yet
    first_margin: int = 0       # bytes step 1 held back for the model's error before measuring it (replan.py)
    allocator: str = ""         # what the caching allocator was set to for the budget (budget.py), if anything
    optimizer: str = ""         # the optimizer state's form the budget chose (first_plan.py), if it chose one
    returned: int = 0           # gradients backward takes for tensors returned beside the loss (plan_and_emit)

    def target(self, resident: int | None = None) -> int:
        """The budget in bytes of the whole step with ``resident`` bytes resident (default: the plan's):
        a fraction f keeps f of the activations, so it stands for ``resident + f * unconstrained`` plus
        what the step holds beside them whatever the plan (``beside``: the loss's workspace, measured or
        declared). Fraction 1 is the step without recompute."""
        kind, value = parse_budget(self.budget)
        resident = self.resident if resident is None else resident
        value = self.share if kind == "fraction" and self.share is not None else value
        return int(resident + value * self.unconstrained + self.beside) if kind == "fraction" else int(value)

    @property
    def beside(self) -> int:
        """Bytes the step holds beside resident + activations whatever the plan: the forward end's
        workspace less the gradients not allocated by then (a timed plan's ``head_excess`` is all of it),
        and the error throughout."""
        return self.excess + (max(0, self.head_excess - sum(self.grads)) if self.timed else self.head_excess)

    def budget_both_units(self) -> tuple[int, float]:
        """The budget as bytes of the whole step and as a share of the unconstrained activations: the
        two are one target, ``bytes = resident + share * unconstrained + beside``."""
        kind, value = parse_budget(self.budget)
        as_bytes = self.target()
        return as_bytes, (value if self.share is None else self.share) if kind == "fraction" else \
            (value - self.resident - self.beside) / max(1, self.unconstrained)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes the plan sends to the host: an offloaded segment's saved bytes (less its weight copies where
        those are recomputed), or its inputs."""
        return sum(self.segments[i].saved - (self.segments[i].casts if i in self.casts else 0) if k == "kept"
                   else self.segments[i].inputs for i, k in self.offloaded.items())

    def planned(self) -> list[int]:
        """The segments the plan acts on, in order: recomputed whole or selectively, their weight copies
        recomputed, or offloaded."""
        return sorted({*self.chosen, *self.selective, *self.offloaded, *self.casts})

    def timeline(self) -> list[tuple[str, int, int]]:
        """Predicted memory over the step at segment granularity: ``(phase, segment, bytes)``.

        Forward: after segment i, resident (less the gradients to come) + what segments 0..i keep (a
        recomputed segment keeps only its inputs). Backward, last segment first: its parameters'
        gradients are allocated (``grads``, a ``"gradients"`` point), a recomputed segment's activations
        are live again while its gradients are computed (``"recompute"`` point), then its kept bytes are
        freed. The maximum is at most ``predicted_peak`` (with ``grads`` known: ``expected_peak``; a byte
        budget's plan predicts it)."""
        chosen, sel = set(self.chosen), {*self.selective, *self.casts}
        kept = [0 if i in self.offloaded else s.inputs if i in chosen or i in sel else s.saved
                for i, s in enumerate(self.segments)]
        points, live = [], self.resident - sum(self.grads)
        for i, k in enumerate(kept):
            live += k
            points.append(("forward", i, live))
        for i in range(len(kept) - 1, -1, -1):
            live += self.grads[i] if self.grads else 0   # its parameters' gradients, allocated here
            if self.grads and self.grads[i]:
                points.append(("gradients", i, live))
            if i in chosen or i in sel or i in self.offloaded:   # recomputed, or back from the host
                # a kept segment's recast weight copies come back beside its reloaded tensors: all of it
                back = self.segments[i].saved - (self.segments[i].inputs if i in sel and i not in self.offloaded else 0)
                points.append(("reload" if i in self.offloaded else "recompute", i, live + back))
            live -= kept[i]
            points.append(("backward", i, live))
        return points

    plot = plan_chart.plot   # the predicted memory over the step as a chart; returns the Axes

    def to_dict(self) -> dict:
        as_bytes, share = self.budget_both_units()
        return dict(budget=str(self.budget), budget_bytes=as_bytes, budget_share=share,
                    resident=self.resident, unconstrained=self.unconstrained,
                    kept=self.kept, transient=self.transient, predicted_peak=self.predicted_peak,
                    chosen=[dict(start=self.segments[i].start, end=self.segments[i].end,
                                 saved=self.segments[i].saved, inputs=self.segments[i].inputs,
                                 cost=self.segments[i].cost, ops=self.ops.get(i, "")) for i in self.chosen],
                    recompute_seconds=self.recompute_seconds, planning_seconds=self.planning_seconds,
                    measured_peak=self.measured_peak, replanned=self.replanned,
                    segmentation=self.segmentation, user_regions=self.user_regions, note=self.note,
                    offloaded={str(i): k for i, k in self.offloaded.items()}, selective=self.selective,
                    casts=self.casts, tensors=self.tensors,
                    offloaded_bytes=self.offloaded_bytes, link=self.link, estimated_by=self.estimated_by, grads=self.grads,
                    expected_peak=self.expected_peak, excess=self.excess, timed=self.timed,
                    head_excess=self.head_excess, modelled=list(self.modelled), measured_ops=self.measured_ops,
                    to_come=self.to_come, first_margin=self.first_margin, allocator=self.allocator,
                    optimizer=self.optimizer, returned=self.returned,
                    timeline=[list(t) for t in self.timeline()])


def clone_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes (and shallow-copied meta) can be re-planned without touching ``gm``."""
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return fx.GraphModule(gm, g)


def plan_and_emit(gm: fx.GraphModule, saved_by: dict[str, int], budget, resident: int,
                  how: str = "checkpoint", earlier: tuple = (), link: float | None = None,
                  grads: dict[str, int] | None = None, timed: bool = True, head: int | None = None,
                  step: tuple | None = None, returned: int = 0) -> Plan:
    """Plan recompute for ``gm`` under ``budget`` given its per-node saved bytes (``analysis``) and rewrite
    it in place: ``how="checkpoint"`` emits ``checkpoint`` calls (eager), ``"tag"`` recompute tags (for Inductor). ``earlier``: the plans
    of the step's graphs captured before this one. A fraction is a share of the whole step's activations:
    a graph keeps what the graphs before it left under their share, or less for what they kept over it;
    one that cannot reach that is planned at its floor, and the step's share is checked when the call
    ends (``check_step_share``); the plan's ``note`` says so. ``link``: host-link bytes/s when saved
    tensors may go to the host (``offload.py``; only with ``how="tag"``). ``grads``: each parameter's
    gradient bytes (in ``resident``), which backward allocates as it frees activations. A byte budget
    (with ``timed``) is planned against that timeline: the peak it predicts is the timeline's maximum. A
    fraction keeps its meaning, a share of the activations, every gradient counted from the start.
    ``head``: bytes live at the end of the forward alone, held there only: measured (``replan.py``), or
    by default the largest workspace an op of the graph declares (the chunked loss's logits) or the
    ``returned`` bytes, whichever is more (the gradients AOTAutograd's backward takes for the tensors the
    graph returns beside its loss, HF's logits: allocated as the backward starts, zeros where the caller
    does not read them), less the gradients a plan that counts them all from the start already holds there. ``step``: for a fraction
    re-planned with its whole step known (``replan.rebalance``), ``(limit, kept)`` in bytes of this
    graph's activations: its backward's peak under ``limit``, what it keeps under ``kept`` (or as little
    as its limit allows)."""
    t0 = time.perf_counter()
    kind, value = parse_budget(budget)
    # two cuts of opsmath's own: local minima of the crossing bytes within 6 positions (block-sized
    # segments), and within 2 (about half-blocks: a smaller largest recompute, so a lower floor)
    # run op by op, a recompute would apply a state update (BatchNorm's statistics) again: pinned; under
    # Inductor, AOTAutograd applies updates once, after the graph, whatever is recomputed
    order = forward_order(gm)
    pinned = pinned_positions(order) if how == "checkpoint" else frozenset()
    # opt-in, on a GPU: each op's time there prices its recompute; under Inductor, what it fuses at a share
    fused = (lambda n: 1.0 if is_compute(n.target) else op_times.FUSED_SHARE) if how == "tag" else None
    measured = op_times.annotate(order, scale=fused)
    pairs = getattr(saved_by, "pairs", None)   # (saver, producer, bytes): the selective candidates need it
    cheap = os.environ.get("OPSMATH_CHEAP_STEPS", "1") != "0"   # "0": the plan without them, to compare
    index = saved_index(pairs, how == "tag" and cheap, getattr(saved_by, "casts", None),
                        getattr(saved_by, "copies", None)) if pairs is not None else None
    saved_by = saved_by if cheap else dict(saved_by)   # a plain dict: no weight copies apart
    options = [("opsmath", segments_of(gm, saved_by, pinned=pinned)),
               ("opsmath-fine", segments_of(gm, saved_by, window=2, pinned=pinned))]
    user = user_segments(gm, saved_by, pinned=pinned)
    if user is not None:
        options.insert(0, ("user", user))
    if how != "tag":
        link = None
    timing = grads if timed and grads and kind == "bytes" else None
    if head is None:
        ws = max(max((node_workspace(n) for n in order), default=0), returned)
        head = max(0, ws - (0 if timing else sum((grads or {}).values())))
    earlier = [p for p in earlier if p is not None]
    if step is not None:
        best, note, share = _for_step(gm, options, resident, step, link, index)
    else:
        best, note, share = _choice(gm, options, resident, kind, value, earlier, link, index, timing, head)
    label, fine, (picked, kept, trans, cost), runs = best
    segs, chosen, kinds = merged(fine, runs, picked)
    by = by_kind(segs, kinds, how)
    selective, gemms, casts, offloaded = by["selective"], by["gemms_recomputed"], by["casts"], by["offloaded"]
    plan = Plan(budget, resident, sum(s.saved for s in segs), kept, trans, resident + kept + trans, segs,
                chosen, cost, segmentation=label, user_regions=len(user_regions(order)), note=note, link=link, **by,
                ops={i: describe(order, segs[i]) for i in {*chosen, *selective, *offloaded, *casts}}, share=share)
    if grads:
        plan.grads = grads_by_segment(gm, segs, grads)
        plan.expected_peak = max(b for _, _, b in plan.timeline())
    plan.timed = bool(timing)
    plan.measured_ops = measured
    plan.modelled = _modelled(plan)
    plan.predicted_peak = max(plan.modelled[1], plan.modelled[0] + head)
    plan.head_excess, plan.returned = head, returned
    if chosen or selective:
        (emit_checkpoints if how == "checkpoint" else tag_recompute)(gm, segs, chosen, selective, gemms)
    weight_casts.mark(n for i in casts for n in order[segs[i].start:segs[i].end + 1])
    offload.mark_offloaded(order, segs, offloaded)
    plan.planning_seconds = time.perf_counter() - t0
    return plan


def by_kind(segs: list[Segment], kinds: dict, how: str) -> dict:
    """``Plan``'s segment lists from a merged choice's kinds (``plan_choice.merged``): selective runs (those
    recomputing GEMMs, those of saved tensors), segments whose weight copies recompute (on the Inductor
    path, ``how == "tag"``), offloaded ones as ``"kept"`` or ``"inputs"`` (a ``"kept+casts"`` segment is in both)."""
    selective = sorted(i for i, k in kinds.items() if k.startswith("selective"))
    return dict(selective=selective, gemms_recomputed=[i for i in selective if kinds[i] == "selective-gemms"],
                tensors=[i for i in selective if kinds[i].startswith(TENSORS)],
                casts=sorted(i for i, k in kinds.items()
                             if (k.endswith("casts") or k == "selective-gemms") and segs[i].casts and how == "tag"),
                offloaded={i: k.removesuffix("+casts") for i, k in kinds.items()
                           if k in ("kept", "kept+casts", "inputs")})


def _choice(gm, options, resident: int, kind: str, value: float, earlier: list, link, index, timing, head):
    """(best option, note, share) for a budget of ``kind``: a fraction as a share of the step (what the
    graphs before it left or took), at the graph's floor where it cannot keep that. Raises the
    InfeasibleBudget of the lowest floor when nothing fits."""
    total = sum(s.saved for s in options[-1][1])
    ask = value
    if kind == "fraction" and earlier and total:   # a share of the step: what the graphs before it left or took
        ask = min(1.0, value + sum(value * p.unconstrained - p.kept for p in earlier) / total)
    # a fraction bounds the activations alone: the loss's workspace is beside them at any fraction
    best, error = best_option(gm, options, resident, kind, max(ask, 1.0 / 4096), link, index, timing,
                               head if kind == "bytes" else 0)
    note = "" if ask == value or best is None else \
        (f"keeps up to {ask:.3f} of its activations, {value:g} of the step's with the graphs before it")
    share = None if ask == value or best is None else ask
    if best is None and kind == "fraction":
        best, note, share = _at_floor(gm, options, resident, value, earlier, error, link, index)
    if best is None:
        raise error
    return best, note, share


def _least_kept(gm, options, resident: int, share: float, link, index):
    """Of the plans whose backward peaks under ``share`` of the graph's activations, the one keeping
    least (bisection on a bound on the kept bytes, to 1/256 of the activations); None if none fits."""
    total = sum(s.saved for s in options[-1][1])
    best, _ = best_option(gm, options, resident, "fraction", share, link, index)
    lo, hi = 0.0, float(best[2][1]) if best is not None else 0.0
    while hi - lo > total / 256:
        mid = (lo + hi) / 2
        got, _ = best_option(gm, options, resident, "fraction", share, link, index, kept_cap=mid)
        lo, hi, best = (lo, mid, got) if got is not None else (mid, hi, best)
    return best


def _for_step(gm, options, resident: int, step: tuple, link, index):
    """(best option, note, share) for ``plan_and_emit``'s ``step``: the cheapest plan under both
    bounds, else the one keeping least under the limit; InfeasibleBudget if not even that fits."""
    total = max(1, sum(s.saved for s in options[-1][1]))
    limit, kept = step
    share = max(limit / total, 1.0 / 4096)
    best, _ = best_option(gm, options, resident, "fraction", share, link, index, kept_cap=max(0.0, kept))
    if best is None:
        best = _least_kept(gm, options, resident, share, link, index)
    if best is None:
        raise InfeasibleBudget(f"no plan of this graph peaks under {_size(limit)} in its backward", resident + limit)
    return best, (f"planned with the whole step: its backward under {limit / total:.3f} of its activations "
                  f"(the step's share less what the graphs before it keep), keeping {best[2][1] / total:.3f}"), share


def _at_floor(gm, options, resident: int, value: float, earlier: list, error, link=None, index=None):
    """(best option, note, share) for a graph that cannot keep its share of the step's activations:
    planned at its own floor (``share``: the lowest peak of its own backward), and of the plans that
    reach it the one keeping least (bisection on the kept bytes, to 1/256 of its activations): what a
    graph keeps is still live while every later graph's backward runs and at the end of the forward,
    where its transient is not (HF BLOOM's 8 layers, split by a GeLU Function: step floor 0.438 -> 0.300).
    The graphs after it keep less, and ``check_step_share`` holds the step's share at the end of the
    call. (None, "", None) when the graph saves nothing."""
    total = sum(s.saved for s in options[-1][1])
    if total <= 0:
        return None, "", None
    lo = (error.floor - resident) / total
    share = min(1.0, lo + 1.0 / 4096)
    best = _least_kept(gm, options, resident, share, link, index)
    if best is None:   # the floor the error names is an estimate: the lowest share a plan fits, by bisection
        hi = 1.0       # (keeping everything fits)
        while hi - lo > 1.0 / 1024:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if best_option(gm, options, resident, "fraction", mid, link, index)[0] else (mid, hi)
        share = hi
        best = _least_kept(gm, options, resident, share, link, index)
    floor = share * total
    kept = best[2][1] if best is not None else floor
    step = (sum(p.kept for p in earlier) + kept) / (sum(p.unconstrained for p in earlier) + total)
    return best, (f"this graph's floor is {floor / total:.3f} of its {_size(total)} of activations, above its "
                  f"share: planned at its floor keeping {kept / total:.3f}, the step so far keeps {step:.3f} of "
                  "its activations" + (" (the graphs after it keep less)" if step > value + STEP_SLACK else "")), share


def _modelled(plan: Plan) -> tuple[int, int]:
    """The plan's model of the step's peak at the end of the forward (everything kept, no gradient
    yet where their timing is planned) and over the whole step, before any measured error."""
    if plan.timed:
        pts = plan.timeline()
        return max(b for ph, _, b in pts if ph == "forward"), max(b for _, _, b in pts)
    return plan.resident + plan.kept, plan.resident + plan.kept + plan.transient
