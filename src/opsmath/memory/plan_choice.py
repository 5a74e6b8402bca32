"""The choice of a recompute plan among a graph's candidate segmentations (``plan.py``): the exact
solve of one segmentation under a budget (``choose``, over ``plan_solve``'s DP), the merged segment list
of a choice, each gradient's segment, and the cheapest feasible segmentation (``best_option``)."""
from __future__ import annotations

import math
import os
from dataclasses import replace

import torch.fx as fx

from opsmath.memory import offload
from opsmath.memory.budget import InfeasibleBudget, _size, fraction_up
from opsmath.memory.plan_solve import (Step, _lowest_peak, _max_saving, _peak, _solve, _steps, conflicts, credited,
                                       suffix)
from opsmath.memory.segments import Segment, forward_order, runs_of
from opsmath.memory.selective import KEEPS, TENSORS, finer, held_inputs, origins, saved_storages, selective

# selective candidates span runs of up to this many segments (a norm's output is often saved by the GEMM
# of the next segment: the run must hold both for the norm's recompute to free it)
SELECTIVE_RUNS = 4
# and ``finer``'s recompute sets, runs of up to this many (a block's residual add sits in the segment before)
FINER_RUNS = 2


def _rank(choice) -> tuple:
    """How ``choose``'s results compare: modelled cost, then predicted kept + transient bytes."""
    picked, kept, trans, cost = choice
    return cost, kept + trans


def choose(segs: list[Segment], runs: dict, resident: int, budget_kind: str, budget: float,
           units: int = 4096, link: float | None = None, sel: dict | None = None, grads: list | None = None,
           head: int = 0, kept_cap: float | None = None, held: dict | None = None) -> tuple[list[Step], int, int, float]:
    """(chosen steps, kept bytes, transient bytes, cost) at the least modelled cost subject to the budget:
    one exact DP (``plan_solve._solve``) in which every step's own backward must fit, so no candidate
    "largest transient" needs enumerating. ``runs`` maps (i, j) to segments i..j recomputed as one unit
    (``segments.runs_of``); ``link``: host-link bytes/s when offload is a choice (``offload.py``); ``sel``:
    the selective candidates by segment (``selective.selective``). ``grads``: per segment, the gradient
    bytes its backward allocates (``grads_by_segment``; in ``resident``): given, a byte budget is held
    at every point of backward with the gradients allocated by then (``plan_solve.suffix``) instead of
    all of them from the start. ``head``: bytes live at the end of the forward alone (the loss's
    measured workspace). ``kept_cap``: a bound on the activation bytes kept at the end of the forward
    alone, tighter than the budget (``_at_floor``). ``held``: runs counted without the inputs saved anyway
    (``selective.held_inputs``): a chosen whole recompute is credited with them where no other chosen step
    recomputes their producers, and the plan solved again under the credit (``_with_held``). Raises
    InfeasibleBudget naming the smallest feasible budget."""
    total, n = sum(s.saved for s in segs), len(segs)
    after = suffix(grads, n)
    base = resident - after[0]   # resident without the gradients backward allocates
    limit = budget * total if budget_kind == "fraction" else budget - base  # on activations + gradients
    prefix = [0]
    for sg in segs:
        prefix.append(prefix[-1] + sg.saved)
    steps = _steps(segs, runs, link, sel)
    unit = max(1.0, total / units)
    fits = _peak(segs, [], after, head) <= limit and (kept_cap is None or total <= kept_cap)
    picked = [] if fits else _pick(segs, {i: list(v) for i, v in steps.items()}, link, held, runs,
                                   (n, unit, prefix, limit, after, head, kept_cap))
    if picked is None:
        # under a bound on what is kept (a bisection's probe), the DP's own bound: that floor is not used
        smallest = _floor(segs, steps, link, held, runs, (n, unit, prefix, total, after, head, kept_cap)) \
            if kept_cap is None else _dp_floor(segs, steps, prefix, unit, n, total, after, head)
        floor = base + math.ceil(smallest)
        asked = _size(budget) if budget_kind == "bytes" else f"{budget:.4g} (fraction)"
        raise InfeasibleBudget(
            f"memory budget {asked} cannot be met: the smallest feasible is about {_size(floor)} ({floor} bytes"
            + (f", fraction {fraction_up(max(0.0, smallest - after[0]) / total)}" if total else "") + ")", floor)
    kept = total - sum(st.saving for st in picked)
    return picked, kept, _peak(segs, picked) - kept, sum(st.cost for st in picked)


def _dp_floor(segs: list[Segment], steps: dict, prefix: list, unit: float, n: int, total: float, after: list,
              head: float) -> float:
    """The DP's own lowest peak (``_lowest_peak``), bisected down from a reachable one: kept + the largest
    transient, at a few transient caps."""
    sizes = sorted({st.size for sts in steps.values() for st in sts})
    reach = min(total - _max_saving(n, steps, T) + T for T in {0, *sizes[:96], *sizes[-1:]}) + after[0] + head
    return _lowest_peak(segs, steps, prefix, unit, reach, after, head)


def _pick(segs: list[Segment], steps: dict, link, held, runs, dp: tuple) -> list[Step] | None:
    """``choose``'s solve under one limit (``dp`` = (n, unit, prefix, limit, after, head, kept_cap)): the
    DP, then steps that assume a value kept which another recomputes dropped and the DP run again, late
    offloads priced at their whole copy time, and the held inputs credited. None where nothing fits.
    ``steps`` is changed (dropped and re-priced steps): callers probing several limits pass copies."""
    n, unit, prefix, limit, after, head, kept_cap = dp
    picked = _solve(n, steps, unit, prefix, limit, after, head, kept_cap)
    for attempt in range(8):   # a step that assumes a value kept which another recomputes: drop it, solve again
        bad = conflicts(segs, picked or [])
        if not bad:
            break
        for st in (bad if attempt < 7 else [s for sts in steps.values() for s in sts if s.reads]):
            steps[st.i] = [s for s in steps[st.i] if s != st]
        picked = _solve(n, steps, unit, prefix, limit, after, head, kept_cap)
    picked = _late_priced(segs, steps, picked, link, dp)
    if picked is not None and held:
        picked = _with_held(segs, steps, picked, held, dp, max(runs[ij].inputs - h.inputs for ij, h in held.items()))
    return picked


def _floor(segs: list[Segment], steps: dict, link, held, runs, dp: tuple) -> float:
    """The lowest limit (activations + gradients, bytes) under which ``_pick`` finds a plan, to within a
    unit: from the DP's own lowest peak (``_dp_floor``: a bound from below, blind to what ``_pick`` does
    after the DP), stepped up until ``_pick`` fits, then bisected. The DP's bound where nothing fits
    below keeping everything."""
    n, unit, prefix, total, after, head, kept_cap = dp
    lo = hi = _dp_floor(segs, steps, prefix, unit, n, total, after, head)

    def fits(limit):
        return _pick(segs, {i: list(v) for i, v in steps.items()}, link, held, runs,
                     (n, unit, prefix, limit, after, head, kept_cap)) is not None
    top, step = total + after[0] + head + unit, max(unit, 0.01 * total)
    bound = lo
    while not fits(hi):
        if hi >= top:
            return bound
        lo, hi, step = hi, min(top, hi + step), 2 * step
    while hi - lo > unit:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _late_priced(segs: list[Segment], steps: dict, picked, link, dp: tuple):
    """``picked`` solved again with its late offloads (``offload.late``: the forward cannot cover their
    copies, so they are waited for at once) priced at their whole copy time, until none is late at the
    price it was chosen at (each round re-prices at least one step, so at most one round per segment)."""
    for _ in range(len(segs)):
        bad = [st for st in (offload.late(segs, picked, link) if link and picked else []) if not st.late]
        if not bad:
            break
        for st in bad:
            full = replace(st, cost=st.cost - offload.step_cost(st.sent, link)
                           + offload.step_cost(st.sent, link, exposed=1.0), late=True)
            steps[st.i] = [full if o == st else o for o in steps[st.i]]
        picked = _solve(*dp[:1], steps, *dp[1:])
    return picked


def _with_held(segs: list[Segment], steps: dict, picked: list[Step], held: dict, dp: tuple,
               one: int = 0) -> list[Step]:
    """``picked`` credited with the inputs its whole recomputes keep anyway (``plan_solve.credited``), and
    the plan solved again under the limit raised by that credit (or ``one``, the largest single run's, if
    more), kept where its own credited peak still fits the real limit and it costs less (halving the credit
    where it does not; 4 solves at most): the DP counts every recompute's inputs, so alone it would
    recompute more than the budget needs."""
    n, unit, prefix, limit, after, head, kept_cap = dp
    total = prefix[-1]
    best = credited(segs, picked, held)
    extra = max(one, sum(a.saving - b.saving for a, b in zip(best, picked)))
    for _ in range(4):
        if extra < unit:
            break
        trial = _solve(n, steps, unit, prefix, limit + extra, after, head,
                       None if kept_cap is None else kept_cap + extra)
        ok = trial is not None and not conflicts(segs, trial)
        if ok:
            trial = credited(segs, trial, held)
            ok = _peak(segs, trial, after, head) <= limit and (
                kept_cap is None or total - sum(st.saving for st in trial) <= kept_cap)
        if ok and sum(st.cost for st in trial) < sum(st.cost for st in best):
            return trial
        extra /= 2
    return best


def merged(segs: list[Segment], runs: dict, picked: list[Step]) -> tuple[list[Segment], list[int], dict[int, str]]:
    """The segment list with each picked run i..j as one segment, the indices of the recomputed ones, and
    the other choices as ``{index: "selective" | "selective-gemms" | "selective-free" | "casts" | "kept" |
    "inputs"}`` (a selective kind or ``"kept"`` may end in ``"+casts"``; the last two are offloaded: the
    segment's saved tensors, or a recomputed run's inputs, ``offload.mark_offloaded``). A kept choice's segment has
    ``inputs``: what it still keeps."""
    out, chosen, kinds, at, i = [], [], {}, {st.i: st for st in picked}, 0
    while i < len(segs):
        st = at.get(i)
        if st is None:
            out.append(segs[i])
            i += 1
            continue
        if st.kind.startswith("selective") or st.kind == "casts":   # kept on the device: what it did not free
            kinds[len(out)] = st.kind
            run = runs[(st.i, st.j)]
            out.append(Segment(run.start, run.end, run.saved, run.saved - st.saving, st.cost, casts=run.casts,
                               cast_cost=run.cast_cost, only=st.only))
            i = st.j + 1
            continue
        if not st.kind.startswith("offload"):
            chosen.append(len(out))
        if st.kind != "recompute":
            kinds[len(out)] = {"offload": "kept", "offload+casts": "kept+casts"}.get(st.kind, "inputs")
        run = runs[(st.i, st.j)]   # a run whose inputs are saved anyway (``held_inputs``) keeps less
        out.append(replace(run, inputs=run.saved - st.saving, reads=st.reads) if st.reads else run)
        i = st.j + 1
    return out, chosen, kinds


def grads_by_segment(gm: fx.GraphModule, segs: list[Segment], grads: dict[str, int]) -> list[int]:
    """Per segment, the gradient bytes backward allocates on reaching it: a parameter's gradient
    (``grads``: bytes by placeholder name) appears at its last use in forward order (a tied embedding's
    at the LM head), the first that backward meets."""
    pos = {n: i for i, n in enumerate(forward_order(gm))}
    out = [0] * len(segs)
    for n in gm.graph.find_nodes(op="placeholder"):
        last = max((pos[u] for u in n.users if u in pos), default=None)
        if n.name in grads and last is not None and segs:
            i = next((k for k, sg in enumerate(segs) if sg.start <= last <= sg.end), len(segs) - 1)
            out[i] += grads[n.name]
    return out


def best_option(gm, options, resident: int, kind: str, value: float, link=None, index=None, grads=None,
                 head: int = 0, kept_cap: float | None = None):
    """The cheapest feasible (label, segments, choice, runs) over the segmentations, and the error with
    the lowest floor when none is feasible. ``index``: the saved bytes' producers (``selective.saved_index``),
    for the selective candidates (``"selective-free"`` on a tagged graph only). ``grads``: gradient bytes by
    placeholder, to plan against their timing (``choose``)."""
    best, errors = None, []
    order = forward_order(gm)
    origin = origins(order)
    kinds = [k for k in KEEPS if index is not None and k != TENSORS and (index.tagged or k != "selective-free")]
    for label, sg in options:
        runs = runs_of(gm, sg)
        sel = {(*ij, k): c for ij, run in runs.items() for k in kinds if ij[1] - ij[0] < SELECTIVE_RUNS
               and (c := selective(order, run, index, k, index.tagged)) is not None}
        kept = saved_storages(order, index) if index is not None and index.tagged else None
        if kept is not None and os.environ.get("OPSMATH_TENSOR_STEPS", "1") != "0":
            # recompute sets below a run, a saved tensor at a time ("0": the plan without them, to compare)
            sel.update({(*ij, TENSORS): c for ij, run in runs.items() if ij[1] - ij[0] < FINER_RUNS
                        and (c := finer(order, run, index, kept, origin=origin))})
        try:
            got = choose(sg, runs, resident, kind, value, link=link, sel=sel,
                         held=held_inputs(order, runs, kept, origin) if kept is not None else None,
                         grads=grads_by_segment(gm, sg, grads) if grads else None, head=head, kept_cap=kept_cap)
        except InfeasibleBudget as e:
            errors.append(e)
            continue
        if best is None or _rank(got) < _rank(best[2]):
            best = (label, sg, got, runs)
    return best, (min(errors, key=lambda e: e.floor) if errors else None)
