"""A compiled graph's side of a memory budget: its first plan (``plan_graph``; a block's piece planned for
its share of a byte budget) and, where the whole graph cannot meet a byte budget, the optimizer's step
moved inside backward with one graph per block (``step_in_backward``, for ``in_backward="auto"``)."""
from __future__ import annotations

import torch.fx as fx

from opsmath.memory import offload, replan
from opsmath.memory.budget import (InfeasibleBudget, expandable_segments, grad_bytes, optimizer_lever,
                                   optimizer_state_to_come, parse_budget, resident_bytes, share_budget)
from opsmath.memory.analysis import partitioned_saved_bytes
from opsmath.memory.first_plan import first_plan
from opsmath.meta_keys import BLOCK_SHARE
from opsmath.optim.footprint import in_backward_lever
from opsmath.runtime import blocks, fp8_weights


def step_in_backward(state, model, gm: fx.GraphModule, error: InfeasibleBudget):
    """Where a byte budget cannot be met by the whole graph and an ``opsmath.optim.AdamW(in_backward="auto")``
    holds the model's parameters: turn its in-backward step on and split ``gm`` block by block (one block's
    gradients alive at a time), the report saying so. Returns ``blocks.split_blocks(gm)``; raises ``error``
    where that lever does not exist."""
    bytes_budget = state.memory_budget is not None and parse_budget(state.memory_budget)[0] == "bytes"
    saved, switch = in_backward_lever(model.parameters()) if bytes_budget else (0, None)
    parts = blocks.split_blocks(gm) if switch is not None else None
    if parts is None:
        raise error
    switch()
    state.notes.append(f"the optimizer steps inside backward (in_backward='auto'), one graph per block, for "
                       f"memory_budget={state.memory_budget!r}: the whole graph could not meet it ({error}); "
                       f"{saved / 2**20:.1f} MiB of gradients are never alive all at once")
    return parts


def plan_graph(state, model, source: fx.GraphModule, gm: fx.GraphModule, by_node, example_inputs, use_inductor):
    """``(first plan, saved bytes by node)`` of the rewritten ``gm`` under the model's memory budget. Under
    Inductor the plan becomes recompute tags its partitioner must honor, and is made for what that
    partitioner saves (less than eager's saved set). A block's piece (``source``: an optimizer stepping
    inside backward) is planned for its share of a byte budget's headroom first (``share_budget``; no
    8-bit lever at a share), at its floor where its share is below it, and for the whole budget where
    even the floor is not under it."""
    how = "tag" if use_inductor else "checkpoint"
    partitioned = partitioned_saved_bytes(gm, fp8_weights.example_inputs(
        state.weight_casts, gm, example_inputs)) if use_inductor else None
    by_node = partitioned or by_node
    to_come = optimizer_state_to_come(example_inputs, model, any(r.calls > 1 and r.training for r in state.graphs))
    resident = resident_bytes(example_inputs, model) + to_come
    measured = replan.measures(example_inputs)
    kw = dict(how=how, earlier=[r.plan for r in state.graphs if r.last_run > state.step_start],
              link=None if state.cuda_graphs else offload.link_for(example_inputs, how),
              grads=grad_bytes(gm, example_inputs))
    plan, share = None, share_budget(state.memory_budget, source.meta.get(BLOCK_SHARE), resident)
    if share is not None:
        plan = _at_share(gm, by_node, share, parse_budget(state.memory_budget)[1], resident, to_come, measured, kw)
    if plan is None:
        plan = first_plan(gm, by_node, state.memory_budget, resident, to_come, measured,
                          lever=optimizer_lever(model, to_come), **kw)
    plan.estimated_by = "Inductor's partition" if partitioned else "eager autograd"
    plan.allocator = expandable_segments(example_inputs, state.memory_budget, state.cuda_graphs)
    return plan, by_node


def _at_share(gm, by_node, share: int, budget: float, resident: int, to_come: int, measured: bool, kw: dict):
    """A block piece's first plan for its ``share`` of a byte budget; where the share is below the piece's
    floor, for the floor (the least it can keep: what it takes beyond its share, the later pieces lose, so
    it takes no more), where that is under the whole ``budget``. None where neither plans."""
    try:
        return first_plan(gm, by_node, share, resident, to_come, measured, **kw)
    except InfeasibleBudget as e:
        if not e.floor or e.floor >= budget:
            return None
        try:
            return first_plan(gm, by_node, min(int(budget), int(e.floor * 1.001) + 1), resident, to_come,
                              measured, **kw)
        except InfeasibleBudget:
            return None
