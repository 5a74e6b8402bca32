"""A memory plan checked against the steps it runs, and made again where the model of the step was wrong.

``plan.py`` plans at a graph's first call from a fake-tensor model of the step. Two things that model
cannot know: the resident bytes after the optimizer's first step (AdamW adds 8 bytes a parameter), and
what the real step holds beyond the activations it counts (the loss's chunk of logits, kernel
workspaces, the allocator's rounding), here called the model's *error*: measured peak - modelled peak.
While a graph is watched (its first ``WATCH_CALLS`` calls):

* call 1 (``opsmath.memory.first_plan``), on CUDA: the plan counts the optimizer state the first ``step()`` will
  allocate (``opsmath.optim.footprint``) and holds ``FIRST_STEP_MARGIN`` of a byte budget's headroom
  back for the model's error, which no step has measured yet, so that step 1 fits too.
* call 2: the resident bytes are measured again and, on CUDA, step 1's peaks (``max_memory_allocated``)
  in two windows, ``measure_to_backward_end``: from the reset at call 1 to the start of the step's
  backward, and from there (reset again) to the backward's end. The first optimizer step, which
  allocates AdamW's state while the gradients are live, is outside both: it is not the plan's to hold,
  and counted as the model's error it cost HF LLaMA 1.1B 1.26 GiB of its budget. Each window is
  compared with the plan's model of it (``Plan.modelled``). Where the resident bytes moved, or the step
  peaked above the model, by more than 1% of the budget, the plan is made again for the budget less the
  backward's error (``Plan.excess``, held at every point) and a margin of ``REPLAN_MARGIN``, and the
  forward's error beyond it held at the end of the forward alone (``Plan.head_excess``: the loss's
  workspace, 0.52 GiB on LLaMA 1.1B, which the timeline of a byte budget would otherwise take off every
  point of the backward too); its predicted peak counts both. A plan that held a first-step margin back
  is made again where the margin was more than step 1 needed (the slack is spent), and where the
  optimizer's state came out smaller than counted.
* call 3: step 2 ran the final plan; if its peak still went over the budget, the plan is tightened once.
* later calls: the resident bytes alone (optimizer state appears only after k micro-batches under
  gradient accumulation).

A fraction f keeps f of the activations: it stands for ``resident + f * unconstrained`` plus the
measured error (``Plan.target``), bytes that move with the resident bytes and the error while the plan's
kept bytes do not, so its plan is never re-made for them (fraction 1 is the step without recompute, 0.5
the same plan as the byte budget of its target). A byte budget is held against the measured peak. Of the graphs that ran in one
step, the one with the most activations carries the error (the step peaks while its activations are live;
a small loss graph beside the model's sees the same peak but does not hold it).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from opsmath.capture.frames import note_source
from opsmath.memory.budget import STEP_SLACK, cuda_device, grad_bytes, resident_bytes, step_peak
from opsmath.memory.plan import InfeasibleBudget, clone_graph_module, parse_budget, plan_and_emit

log = logging.getLogger("opsmath")

REPLAN_MARGIN = 0.02
# calls of a graph during which its plan is re-checked against the resident bytes: with gradient
# accumulation over k micro-batches the optimizer state appears only after call k
WATCH_CALLS = 16


def runner(state, record, fn, base, by_node, model, use_inductor, finish):
    """The callable dynamo calls for ``record``'s graph: runs ``fn``, and while its memory plan is watched
    measures the steps and swaps in a re-planned graph (``finish(state, record, gm, args, use_inductor)``
    compiles one). ``base``: an unplanned copy of the rewritten graph, or None when nothing is planned."""
    start = [None]   # where the current step's peak measurement began (CUDA)
    record.base, record.saved_by = base, by_node

    def run(*args):
        nonlocal fn
        record.calls += 1
        state.graph_runs += 1
        previous, record.last_run = record.last_run, state.graph_runs
        g, watched = None, record.plan is not None and base is not None
        if watched and 2 <= record.calls <= WATCH_CALLS:
            args_ = list(args)
            if record.calls == 2:    # step 1 measured: re-plan for what it showed
                g = recheck(state, record, base, by_node, args_, model, use_inductor, start[0], previous)
            elif record.calls == 3:   # the plan's own first step: tightened once if over
                g = tighten(state, record, base, by_node, args_, model, use_inductor, start[0], previous)
            else:   # optimizer state that appears late (gradient accumulation)
                g = recheck(state, record, base, by_node, args_, model, use_inductor, None, previous)
            if g is not None:
                record.graph, record.after_code = g, g.code
                fn = finish(state, record, g, args_, use_inductor)
        try:
            if watched and record.calls < 3:   # measure the step about to run
                start[0], record.step_peak, record.step_gap = start_peak(args), None, 0
                out = fn(*args)
                if start[0] is not None:
                    measure_to_backward_end(state, record, out, args)
                return out
            return fn(*args)
        except Exception as e:
            note_source(e)
            raise
    return run


def measure_to_backward_end(state, record, out, args) -> None:
    """Record the measured step's peaks in ``record.step_peak``: ``(forward, backward)``, the first read
    when the step's backward starts (at the first graph it reaches, which resets the peak statistic
    there, once per backward: every graph of the step shares the reading), the second when that backward
    ends. A hook on the first output that needs a gradient queues the end's callback; gradients pass
    through unchanged. ``record.step_gap``: what the allocator reserved beyond the allocated peak in
    either window (fragmentation, and blocks cached from before the step), which a budget holds too."""
    outs = out if isinstance(out, (list, tuple)) else [out]
    t = next((o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad and o.grad_fn is not None), None)
    if t is None:
        return

    def at_backward(grad):
        if state.forward_peak is None:   # the first graph this backward reaches
            state.forward_peak = max_allocated(args)
            state.forward_gap = _gap(args, state.forward_peak)
            start_peak(args)
        forward, gap = state.forward_peak, state.forward_gap

        def done():
            backward = max_allocated(args)
            record.step_peak, state.forward_peak = (forward, backward), None
            record.step_gap = max(gap, _gap(args, backward))
        torch.autograd.Variable._execution_engine.queue_callback(done)
    t.register_hook(at_backward)


def _gap(args, allocated) -> int:
    """Reserved beyond ``allocated`` at the peak of the window measured now (0 off CUDA)."""
    device = cuda_device(args)
    if device is None or allocated is None:
        return 0
    return max(0, torch.cuda.max_memory_reserved(device) - allocated)


def _step_peaks(record, args) -> tuple:
    """``(forward, backward)`` peaks of the measured step; ``(whole step, None)`` where no backward ran
    through the hook (read now)."""
    return record.step_peak if record.step_peak is not None else (max_allocated(args), None)


def _above(plan, errors: tuple, modelled: tuple | None = None) -> int:
    """How far the measured step (``errors``, from ``_errors``) went above ``plan``'s predicted peak
    (its model ``modelled``, default ``plan.modelled``)."""
    every, head = errors
    f, b = modelled or plan.modelled
    predicted = max(b, f + plan.head_excess) + plan.excess
    return max(b + every, f + every + head) - predicted


def _errors(modelled: tuple, peaks: tuple) -> tuple[int, int]:
    """``(excess, head)``: the measured bytes above a model ``(end of forward, whole step)``, as what every
    point of the step gets (the backward's error, or the whole step's where only that was measured) and
    what the end of the forward gets beyond it (the loss's workspace: the step peaks there)."""
    forward, backward = peaks
    if backward is None:
        return max(0, forward - modelled[1]), 0
    excess = max(0, backward - modelled[1])
    return excess, max(0, forward - modelled[0] - excess)


def measures(args) -> bool:
    """Whether the steps of a graph with inputs ``args`` are measured (on CUDA): ``first_plan`` holds a
    margin back only for an error that step 1 will measure."""
    return cuda_device(args) is not None


def start_peak(args) -> Optional[int]:
    """Where a step's peak measurement starts (the graph's first and second calls): CUDA's peak statistic
    is reset (``reset_peak_memory_stats``), so the step is measured even when something earlier in the
    process peaked higher; ``optimize`` documents this. None off CUDA."""
    device = cuda_device(args)
    if device is None:
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def max_allocated(args) -> Optional[int]:
    device = cuda_device(args)
    return torch.cuda.max_memory_allocated(device) if device is not None else None


def _carries_error(state, record, since: int) -> bool:
    """Whether ``record``'s graph holds the step's peak: of the planned graphs that ran since its
    previous call (one step), it has the most activations."""
    step = [r.plan.unconstrained for r in state.graphs if r.plan is not None and r.last_run > since]
    return record.plan.unconstrained >= max(step, default=0)


def recheck(state, record, base, by_node, args, model, use_inductor, peak_before, since):
    """At the graph's second call (and, for the resident bytes alone, its later calls up to
    ``WATCH_CALLS``). A byte budget is re-planned when the resident bytes grew; a fraction's target grows
    with them and with the measured error, so its plan stays and only its prediction counts them
    (``follow``). A byte budget is re-planned when step 1
    peaked above the model by more than 1% of the budget, for the budget less that error and the margin
    (measured on the H200, GPT-2-small under Inductor: 0.2-0.3 GiB, 6-9% of the activations; the step
    peaks at the end of its forward, where the loss's chunk of logits is live, which the model omits). Returns the re-planned graph or None; an infeasible budget
    raises ``InfeasibleBudget``."""
    old = record.plan
    resident = resident_bytes(args, model)
    peaks = _step_peaks(record, args) if peak_before is not None else (None, None)
    measured = None if peaks[0] is None else max(peaks[0], peaks[1] or 0)
    if measured is not None:
        old.measured_peak = measured
    carries = measured is not None and _carries_error(state, record, since)
    # step 1 ran before the optimizer state that its plan counted existed
    ahead = old.to_come if peaks[0] is not None and record.calls == 2 else 0
    modelled = (old.modelled[0] - ahead, old.modelled[1] - ahead)
    gap = getattr(record, "step_gap", 0) if carries else 0   # the budget holds in reserved memory
    errors = _errors(modelled, peaks) if carries else (0, 0)
    errors = (errors[0] + gap, errors[1])
    error = _above(old, errors, modelled)
    slack = int(0.01 * old.target())
    # the errors are the model's, not the plan's: a loose plan hides the forward end's error under its
    # backward peak (error 0), and the tighter plan made when the resident bytes grow meets it; a graph
    # that does not carry the step's error had none to hold back
    excess = errors if carries else (0 if old.first_margin else old.excess, old.head_excess)
    fraction = parse_budget(state.memory_budget)[0] == "fraction"
    if fraction and record.pending is not None:   # planned again with its whole step known (``rebalance``)
        (plan, g), record.pending = record.pending, None
        plan.measured_peak, record.plan = old.measured_peak, plan
        plan.replanned = "the whole step planned again after its first call"
        follow(plan, resident, excess)
        return g
    # grown at any watched call; shrunk at call 2 only (the state counted for step 1 was more than the
    # optimizer allocated), so resident bytes that come and go cannot re-plan (recompile) call after call
    moved = not fraction and (resident > old.resident + slack
                              or (record.calls == 2 and resident < old.resident - slack))
    spend = bool(old.first_margin) and measured is not None and error < -slack   # held back more than needed
    if fraction or (not moved and not spend and error <= slack):
        follow(old, resident, errors if fraction and carries else None)
        return None
    goal = old.target(resident)
    held = max(error, *errors) > slack   # a measured error the re-plan holds, with the margin
    why = (f"{old.replanned + '; ' if old.replanned else ''}"
           + (f"resident {old.resident / 2**20:.1f} -> {resident / 2**20:.1f} MiB at call {record.calls}"
              if resident != old.resident else f"call {record.calls}"))
    if measured is not None:
        why += f"; step 1 held {old.first_margin / 2**20:.1f} MiB back for the model's error" if old.first_margin else ""
        why += (f"; step 1 measured {measured / 2**20:.1f} MiB, {abs(error) / 2**20:.1f} MiB "
                f"{'over' if error >= 0 else 'under'} the model"
                + (f", {errors[1] / 2**20:.1f} MiB more at the end of the forward alone" if errors[1] else "")
                + (f", {gap / 2**20:.1f} MiB reserved beyond the allocated peak" if gap else "")
                + (", taken off the budget" if held else ", within 1% of the budget"))
    return _plan_again(state, record, base, by_node, goal, excess, resident, use_inductor, why, peaks, args, held)


def follow(plan, resident: int, errors: tuple | None = None) -> None:
    """The plan stays; its prediction follows the resident bytes and, given, the measured ``errors``
    (``_errors``): a fraction's, which keeps its share of the activations whatever else the step holds
    (its target in bytes, ``Plan.target``, counts them too)."""
    moved, before = resident - plan.resident, plan.excess
    plan.resident, plan.modelled = resident, (plan.modelled[0] + moved, plan.modelled[1] + moved)
    if errors is not None:
        plan.excess, plan.head_excess = errors
    plan.expected_peak = plan.expected_peak and plan.expected_peak + moved + plan.excess - before
    forward, step = plan.modelled
    plan.predicted_peak = max(step, forward + plan.head_excess) + plan.excess


def tighten(state, record, base, by_node, args, model, use_inductor, peak_before, since):
    """At the graph's third call: the step that just ran was the final plan's first. If its measured peak
    exceeded the budget, the plan is made once more for the budget less the model's error now and the
    margin. Returns the re-planned graph or None."""
    peaks = _step_peaks(record, args) if peak_before is not None else (None, None)
    if peaks[0] is None:
        return None
    gap = getattr(record, "step_gap", 0)   # reserved beyond allocated: the budget holds there
    old, measured = record.plan, max(peaks[0], peaks[1] or 0)
    old.measured_peak = measured
    measured += gap
    goal = old.target()
    # a block piece kept within its share peaks in its backward up to the whole budget (``_at_share``)
    bound = parse_budget(state.memory_budget)[1] if getattr(old, "share_step", False) else goal
    if measured <= bound or not _carries_error(state, record, since) \
            or parse_budget(state.memory_budget)[0] == "fraction":   # a share of the activations: kept
        return None
    why = (f"{old.replanned + '; ' if old.replanned else ''}the next step measured {measured / 2**20:.1f} MiB"
           f"{' reserved' if gap else ''}, {(measured - bound) / 2**20:.1f} MiB over the budget: tightened")
    every, head = _errors(old.modelled, peaks)
    return _plan_again(state, record, base, by_node, goal, (every + gap, head), resident_bytes(args, model),
                       use_inductor, why, peaks, args, True)


def _plan_again(state, record, base, by_node, goal, excess, resident, use_inductor, why, peaks, args, measured):
    """Plan ``base`` (a fresh copy of the rewritten graph) again for ``goal`` bytes less the model's
    error ``excess`` = (at every point, beyond that at the end of the forward: ``_errors``), counted in
    the new plan's predicted peak, and the margin where the error was ``measured`` (not the declared
    workspace alone); record why. A byte budget is planned against
    the gradients' timing; where that leaves no feasible plan, it is planned with every gradient resident
    from the start (whose count covers the loss's workspace where the gradients are larger) and that
    model's own error."""
    # a block piece's share bounds what it keeps too (``runtime.budgets.plan_graph``): planned untimed
    timed = parse_budget(state.memory_budget)[0] == "bytes" and not getattr(record.plan, "share_of_budget", False)
    try:
        plan, g = _plan_for(state, record, base, by_node, goal, excess, resident, use_inductor, why, args, timed,
                            measured)
    except InfeasibleBudget:
        old = record.plan
        if not (timed and old.timed and peaks[0] is not None):
            raise
        coarse = _errors((old.resident + old.kept, old.resident + old.kept + old.transient), peaks)
        coarse = coarse if max(coarse) > int(0.01 * goal) else (0, 0)
        plan, g = _plan_for(state, record, base, by_node, goal, coarse, resident, use_inductor, why, args, False,
                            max(coarse) > 0)
    plan.measured_peak = None if peaks[0] is None else max(peaks[0], peaks[1] or 0)
    record.plan = plan
    log.warning("opsmath: graph %d re-planned for memory_budget=%r: %s", record.index, state.memory_budget, why)
    return g


def _plan_for(state, record, base, by_node, goal, excess, resident, use_inductor, why, args, timed, measured):
    """(plan, graph): ``base`` planned for ``goal`` less ``excess[0]`` and, where ``measured``, the margin;
    ``excess[1]`` more held at the end of the forward."""
    g = clone_graph_module(base)
    every, head = excess
    budget = goal - every - (int(REPLAN_MARGIN * goal) if measured else 0)
    # a block piece below its floor keeps within its share, its backward under the whole budget (``_at_share``)
    step = (max(0, parse_budget(state.memory_budget)[1] - every - resident), max(0, budget - resident)) \
        if getattr(record.plan, "share_step", False) else None
    try:
        how = "tag" if use_inductor else "checkpoint"
        plan = plan_and_emit(g, by_node, budget, resident, how=how, link=record.plan.link, grads=grad_bytes(g, args),
                             timed=timed, head=head, step=step)
    except InfeasibleBudget as e:
        raise InfeasibleBudget(f"memory_budget={state.memory_budget!r} no longer fits after step "
                               f"{record.calls - 1} ({why}): {e}", e.floor) from None
    # a block's piece keeps its share (``share_budget``) as its budget; any other graph has the model's
    plan.estimated_by, plan.budget, plan.allocator = record.plan.estimated_by, record.plan.budget, record.plan.allocator
    plan.optimizer, plan.share_of_budget = record.plan.optimizer, getattr(record.plan, "share_of_budget", False)
    plan.share_step = step is not None
    plan.excess, plan.predicted_peak = every, plan.predicted_peak + every
    plan.expected_peak = plan.expected_peak and plan.expected_peak + every
    plan.replanned = why
    return plan, g


def rebalance(state, records: list) -> bool:
    """After a step's first call, where its graphs (split by graph breaks, each planned as it was
    captured) keep more than the fraction of the step's activations: plan them again, the whole step
    known. With ``B`` = fraction x the step's activations, graph k is planned with its backward's peak
    under ``B`` less what the graphs before it now keep, keeping at most ``a`` x its activations (else
    as little as its backward allows: ``plan_and_emit``'s ``step``); ``a`` is the largest (the least
    recompute) at which the step fits, by bisection. Each new plan is installed at its graph's next call
    (``recheck``): the first step ran above the fraction, and a warning says so. Returns False where it
    does not apply (``check_step_share`` then holds the step); raises InfeasibleBudget naming the floor of
    the step planned as a whole where even keeping least does not fit. Not for a graph that ran twice
    in the step (one graph serving several modules)."""
    kind, value = parse_budget(state.memory_budget)
    recs = sorted((r for r in records if r.plan is not None), key=lambda r: r.index)
    if kind != "fraction" or len(recs) < 2 or any(r.calls != 1 or r.base is None for r in recs):
        return False
    first = [r.plan for r in recs]
    total = sum(p.unconstrained for p in first)
    if step_peak(first) <= (value + STEP_SLACK) * total:
        return False
    best, lo, hi = _step_plans(state, recs, 0.0, value * total), 0.0, 1.0
    if best is None:
        floor = _step_plans(state, recs, 0.0, total)
        share = step_peak([p for _, p, _ in floor]) / total if floor else 1.0
        raise InfeasibleBudget(
            f"memory budget {value:.4g} (fraction) cannot be met: the smallest feasible is about fraction "
            f"{share:.3f} over the step's {len(recs)} graphs (split by graph breaks), planned together",
            int(max(p.resident for p in first) + share * total))
    while hi - lo > 1 / 64:
        mid = (lo + hi) / 2
        got = _step_plans(state, recs, mid, value * total)
        lo, hi, best = (mid, hi, got) if got is not None else (lo, mid, best)
    for r, p, g in best:
        r.pending = (p, g)
    log.warning("opsmath: memory_budget=%r: the step's %d graphs, planned one by one, kept %.3f of its "
                "activations; planned again with the whole step known (%.3f), from the next step on",
                state.memory_budget, len(recs), step_peak(first) / total, step_peak([p for _, p, _ in best]) / total)
    return True


def _step_plans(state, recs: list, share: float, budget: float):
    """``[(record, plan, graph)]``: each graph planned in order with its backward under ``budget`` less
    what the graphs before it keep and at most ``share`` of its activations kept; None where a graph has
    no plan or the step's peak (``step_peak``) goes over ``budget``."""
    before, out = 0, []
    for r in recs:
        g = clone_graph_module(r.base)
        try:
            p = plan_and_emit(g, r.saved_by, state.memory_budget, r.plan.resident,
                              how="tag" if r.inductor else "checkpoint", link=r.plan.link,
                              head=r.plan.head_excess, step=(budget - before, share * r.plan.unconstrained))
        except InfeasibleBudget:
            return None
        p.estimated_by = r.plan.estimated_by
        out.append((r, p, g))
        before += p.kept
    return out if step_peak([p for _, p, _ in out]) <= budget * (1 + 1e-9) else None
