"""The plan of a graph's first call: a byte budget that holds from step 1.

Step 1 runs before anything has measured it: the optimizer state its first ``step()`` allocates does not
exist yet, and neither does the model's error (``opsmath.memory.replan``: workspaces, fp32 gradients,
the allocator's rounding). On CUDA the plan counts the state to come (``opsmath.optim.footprint``, in
``resident``) and holds a margin of the budget's headroom back for the error; ``replan.recheck`` replaces
both by what step 1 measured at the graph's second call.
"""
from __future__ import annotations

from opsmath.memory.budget import InfeasibleBudget, _size, parse_budget
from opsmath.memory.plan import plan_and_emit

# step 1's plan holds this share of a byte budget's headroom (the budget less the resident bytes) back for
# what the model of the step does not count, until step 1 has measured it (H200, GPT-2-small B1 T65536
# under "8GiB": 1.21 GiB of 5.3 GiB, 23%: the loss's and attention backward's workspaces, fp32 gradients)
FIRST_STEP_MARGIN = 0.25


def first_plan(gm, by_node, budget, resident: int, to_come: int, measured: bool, lever=(0, None), **kw):
    """The plan of a graph's first call (``plan_and_emit``'s arguments; ``resident`` counts ``to_come``
    bytes of optimizer state that step 1 will not hold yet). Where step 1 will be measured (``measured``:
    CUDA), a byte budget is planned for ``FIRST_STEP_MARGIN`` of its headroom less, held as the plan's
    ``excess`` in its predicted peak until ``recheck`` replaces it by the measured error; where that
    leaves no feasible plan, for the lowest budget that is feasible, the margin what is left.

    A budget that even the resident bytes and the least the activations can keep exceed is met, where
    ``lever`` offers it (``opsmath.optim.footprint.eight_bit_lever``: optimizers with
    ``state_bits="auto"``), with 8-bit optimizer state, the plan's ``optimizer`` saying so; else it raises
    InfeasibleBudget before the first step, naming the optimizer state it counted."""
    try:
        plan = _with_margin(gm, by_node, budget, resident, measured, **kw)
    except InfeasibleBudget as e:
        saved, switch = lever
        try:
            if not saved:
                raise
            plan = _with_margin(gm, by_node, budget, resident - saved, measured, **kw)
        except InfeasibleBudget as last:
            if not to_come:
                raise e from None
            hint = (f"; with 8-bit state it needs about {_size(last.floor)}" if last is not e
                    else " (opsmath.optim.AdamW(state_bits=8) holds 2 bytes a parameter)")
            raise InfeasibleBudget(f"{e}; the resident bytes count {_size(to_come)} of optimizer state that its "
                                   f"first step allocates{hint}", e.floor) from None
        switch()
        to_come -= saved
        plan.optimizer = (f"optimizer state made 8-bit (state_bits='auto'): {_size(saved)} saved; at 32 bits the "
                          f"budget needs {_size(e.floor)}")
    plan.budget, plan.to_come = budget, to_come
    plan.excess, plan.predicted_peak = plan.first_margin, plan.predicted_peak + plan.first_margin
    plan.expected_peak = plan.expected_peak and plan.expected_peak + plan.first_margin
    return plan


def _with_margin(gm, by_node, budget, resident: int, measured: bool, **kw):
    """``plan_and_emit`` for ``budget`` less the first-step margin where it applies, or less what is left
    of it where the whole margin leaves no feasible plan; ``plan.first_margin``: the margin held."""
    kind, value = parse_budget(budget)
    margin = int(FIRST_STEP_MARGIN * max(0, value - resident)) if kind == "bytes" and measured else 0
    try:
        plan = plan_and_emit(gm, by_node, value - margin if margin else budget, resident, **kw)
    except InfeasibleBudget as e:
        if not margin or e.floor >= value:
            raise
        margin = max(0, int(value) - e.floor - int(0.001 * value))
        try:
            plan = plan_and_emit(gm, by_node, value - margin, resident, **kw)
        except InfeasibleBudget:   # the floor is an estimate: the budget itself, no margin, last
            margin = 0
            plan = plan_and_emit(gm, by_node, budget, resident, **kw)
    plan.first_margin = margin
    return plan
