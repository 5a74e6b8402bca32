"""A compiled graph's side of a memory budget: its first plan (``plan_graph``; a block's piece planned for
its share of a byte budget, after the floors of the pieces behind it: ``reserve_floors``) and, where the
whole graph cannot meet a byte budget, the optimizer's step moved inside backward with one graph per
block (``step_in_backward``, for ``in_backward="auto"``)."""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

from opsmath.capture.loss_head import returned_gradient_bytes
from opsmath.capture.lower import lower_to_aten
from opsmath.memory import offload, replan
from opsmath.memory.analysis import partitioned_saved_bytes, saved_bytes_by_node
from opsmath.memory.budget import (InfeasibleBudget, expandable_segments, grad_bytes, optimizer_lever,
                                   optimizer_state_to_come, parse_budget, resident_bytes, share_budget)
from opsmath.memory.first_plan import first_plan
from opsmath.memory.plan import clone_graph_module, plan_and_emit
from opsmath.meta_keys import BLOCK_SHARE
from opsmath.optim.footprint import in_backward_lever
from opsmath.runtime import blocks, fp8_weights

log = logging.getLogger("opsmath")


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
    even the floor is not under it. A share is planned with every gradient of the piece resident from
    the start (not against their timing, under which what it keeps could fill the space its gradients
    take later: that space is not free while the later pieces' backwards run)."""
    how = "tag" if use_inductor else "checkpoint"
    partitioned = partitioned_saved_bytes(gm, fp8_weights.example_inputs(
        state.weight_casts, gm, example_inputs)) if use_inductor else None
    by_node = partitioned or by_node
    to_come = optimizer_state_to_come(example_inputs, model, any(r.calls > 1 and r.training for r in state.graphs))
    resident = resident_bytes(example_inputs, model) + to_come
    measured = replan.measures(example_inputs)
    kw = dict(how=how, earlier=[r.plan for r in state.graphs if r.last_run > state.step_start],
              link=None if state.cuda_graphs else offload.link_for(example_inputs, how),
              grads=grad_bytes(gm, example_inputs), returned=returned_gradient_bytes(source) if use_inductor else 0)
    plan, share = None, share_budget(state.memory_budget, source.meta.get(BLOCK_SHARE), resident)
    if share is not None:   # untimed: what it keeps is bounded too, alive while the later pieces run
        plan = _at_share(gm, by_node, share, parse_budget(state.memory_budget)[1], resident, to_come, measured,
                         dict(kw, grads=None))
        if plan is not None:
            plan.share_of_budget = True
    if plan is None:
        plan = first_plan(gm, by_node, state.memory_budget, resident, to_come, measured,
                          lever=optimizer_lever(model, to_come), **kw)
    plan.estimated_by = "Inductor's partition" if partitioned else "eager autograd"
    plan.allocator = expandable_segments(example_inputs, state.memory_budget, state.cuda_graphs)
    return plan, by_node


def _at_share(gm, by_node, share: int, budget: float, resident: int, to_come: int, measured: bool, kw: dict):
    """A block piece's first plan for its ``share`` of a byte budget. Where no plan peaks under the share
    (the piece's floor is above it), what the piece keeps is still bounded by its share, since that stays
    alive while every later piece runs, but its backward may peak up to the whole ``budget``: the later
    pieces' backwards have run and freed theirs by then (``plan_and_emit``'s ``step``: the cheapest plan
    under both bounds, else the one keeping least). Where even that fails, for the piece's floor (the
    floor a failed plan names is an estimate, so up to three tries), where that is under the whole
    ``budget``. None where nothing plans."""
    try:
        return first_plan(gm, by_node, share, resident, to_come, measured, **kw)
    except InfeasibleBudget as e:
        floor = e.floor
    if budget > resident:
        try:
            # (no first-step margin: it would be counted in the prediction, not in either bound)
            plan = first_plan(gm, by_node, share, resident, to_come, False,
                              **dict(kw, step=(budget - resident, max(0, share - resident))))
            plan.share_step = True   # a re-plan (``replan._plan_for``) keeps both bounds
            return plan
        except InfeasibleBudget:
            pass
    ask = share
    for _ in range(3):
        if not floor or floor >= budget:
            return None
        ask = min(int(budget), max(ask + 1, int(floor * 1.001) + 1))
        try:
            return first_plan(gm, by_node, ask, resident, to_come, measured, **kw)
        except InfeasibleBudget as e:
            floor = e.floor
    return None


def reserve_floors(state, parent: fx.GraphModule, names: list[str], use_inductor: bool, rewrite=None) -> None:
    """Under a byte budget, before any block's piece runs: each piece's floor (``piece_floor``), and in
    each piece's ``BLOCK_SHARE`` the most that a later piece needs while its backward runs (its floor
    and its gradients), less the piece's own gradients (not allocated yet then), which ``share_budget``
    keeps back from its share: the earlier pieces, which plan first, no longer keep what a later one
    cannot do without (HF LLaMA 1.1B's last piece, its head and loss: half its activations). Pieces of
    one structure (the middle blocks) are analyzed once; a piece that cannot be analyzed reserves
    nothing, and the report says so. ``rewrite(piece, captured)``: the piece's lowered graph with the
    model's rewrites applied (the chunked loss keeps no logits), where the caller gives it."""
    if state.memory_budget is None or parse_budget(state.memory_budget)[0] != "bytes":
        return
    how, seen, floors = "tag" if use_inductor else "checkpoint", {}, []
    for name in names:
        piece = getattr(parent, name)
        key = _structure(piece)
        if key not in seen:
            seen[key] = piece_floor(piece, how, rewrite)
        floors.append(seen[key])
    for i, name in enumerate(names):
        meta = getattr(parent, name).meta
        need = max((f + g for f, g in floors[i + 1:] if f is not None), default=0)
        meta[BLOCK_SHARE] = (*meta[BLOCK_SHARE][:3], max(0, need - floors[i][1]))
    blind = [name for name, (f, _) in zip(names, floors) if f is None]
    if blind:
        state.notes.append(f"memory_budget={state.memory_budget!r}: the floors of {len(blind)} of {len(names)} "
                           "block graphs could not be estimated before they run (symbolic sizes or no example "
                           "values); the pieces before them keep nothing back for them")


def piece_floor(piece: fx.GraphModule, how: str, rewrite=None) -> tuple[int | None, int]:
    """``(floor, gradients)`` in bytes beyond what is resident: the least a block's piece peaks at in its
    forward and backward (its plan's floor for a 1-byte budget; kept tensors at full recompute are its
    inputs, which the pieces hand on and ``BLOCK_SHARE`` counts apart), and its parameters' gradients.
    Planned on its dynamo example values, lowered to ATen and rewritten where ``rewrite`` is given
    (``reserve_floors``): eager's saved set, an estimate of what its Inductor-partitioned graph saves.
    ``(None, gradients)`` where it cannot be analyzed."""
    args = [n.meta.get("example_value") for n in piece.graph.find_nodes(op="placeholder")]
    tensors = all(isinstance(a, torch.Tensor) and all(isinstance(s, int) for s in a.shape) for a in args)
    grads = sum(a.numel() * a.element_size() for a in args if tensors and a.requires_grad and a.is_leaf)
    try:
        captured = lower_to_aten(clone_graph_module(piece), args) if tensors else None
        gm = (rewrite(piece, captured) if rewrite is not None else captured.gm) if captured else None
        by_node = saved_bytes_by_node(gm, captured.requires_grad) if captured else None
        if by_node is None:
            return None, grads
        plan_and_emit(gm, by_node, 1, 0, how=how)
    except InfeasibleBudget as e:
        return e.floor, grads
    except Exception:  # noqa: BLE001 (an estimate: without it the pieces plan for their shares alone)
        log.info("opsmath: a block graph's floor could not be estimated", exc_info=True)
        return None, grads
    return 0, grads   # (saves nothing)


def _structure(piece: fx.GraphModule) -> tuple:
    """What makes two pieces' floors equal: their ops and value sizes in order, names aside (a symbolic size
    by its expression: an expert's data-dependent row count is a SymInt, which does not hash)."""
    def val(n):
        v = n.meta.get("example_value")
        return (tuple(map(str, v.shape)), v.dtype, v.requires_grad) if isinstance(v, torch.Tensor) \
            else type(v).__name__
    return tuple((n.op, "" if n.op in ("placeholder", "get_attr") else str(n.target), val(n))
                 for n in piece.graph.nodes)
