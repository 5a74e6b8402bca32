"""The spellings of a loop over experts the experts family reads (``experts.py``): how an expert's rows
are picked (``routing``: ``torch.where(sel == i)``, ``one_hot(sel)[..., i]``; ``masks_to_indices``:
DeepSeek-MoE's ``x[sel == i]``) and how its result goes into the output (``accumulation``).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import VIEWS, aten, is_op, shape, val


def routing(where: fx.Node) -> Optional[tuple[fx.Node, int, tuple]]:
    """``(selected, expert id, axes)`` when ``where`` is ``torch.where(mask)`` over one expert's entries
    of an index tensor: ``selected == i`` or ``one_hot(selected)`` (permuted) at ``i``. ``axes[j]`` is the
    axis of ``selected`` that output ``j`` of the where indexes."""
    if len(where.args) != 1 or where.kwargs:
        return None
    m = where.args[0]
    if is_op(m, {aten.eq.Scalar}) and isinstance(m.args[1], int) and isinstance(m.args[0], fx.Node):
        return m.args[0], m.args[1], tuple(range(len(shape(m.args[0]))))
    if not (is_op(m, {aten.select.int}) and isinstance(m.args[2], int)):
        return None
    src, perm = m.args[0], None
    if is_op(src, {aten.permute.default}):
        src, perm = src.args[0], list(src.args[1])
    if not is_op(src, {aten.one_hot.default}) or not isinstance(src.args[0], fx.Node):
        return None
    labels = [*range(len(shape(src.args[0]))), "E"]
    if perm is not None:
        labels = [labels[p % len(labels)] for p in perm]
    d = m.args[1] % len(labels)
    if labels[d] != "E":
        return None
    return src.args[0], m.args[2], tuple(x for i, x in enumerate(labels) if i != d)


def accumulation(tok: fx.Node) -> Optional[tuple[fx.Node, fx.Node, fx.Node, tuple]]:
    """``(acc_in, acc, contrib, extra)``: the op adding this expert's rows into the output."""
    for u in tok.users:
        t = u.target
        if t in (aten.index_add_.default, aten.index_add.default) and u.args[2] is tok and u.args[1] == 0 \
                and len(u.args) == 4 and not u.kwargs:
            return u.args[0], u, u.args[3], ()
        if t is aten.index_put_.default and list(u.args[1]) == [tok]:
            acc_in, v = u.args[0], u.args[2]
            if len(u.args) > 3 and u.args[3]:
                return acc_in, u, v, ()
            if is_op(v, {aten.add_.Tensor, aten.add.Tensor}) and len(v.args) == 2 and not v.kwargs \
                    and is_op(v.args[0], {aten.index.Tensor}) and list(v.args[0].args[1]) == [tok]:
                return acc_in, u, v.args[1], (v, v.args[0])
            if len(shape(tok.args[0].args[0])) == 1:   # y[rows of i] = ...: a 1-D routing, one expert a row
                return acc_in, u, v, ASSIGN
    return None


ASSIGN = ("assign",)   # ``extra`` of an accumulation that assigns its rows (no node of its own)


def masks_to_indices(graph: fx.Graph) -> None:
    """``x[sel == i]`` and ``y[sel == i] = v`` (a boolean mask of a 1-D integer routing, DeepSeek-MoE's
    spelling) become ``x[where(sel == i)[0]]`` and ``y[where(sel == i)[0]] = v``: the same rows, as an
    index the loop matcher reads; one ``where`` per (routing, expert), shared by its gathers and writes.
    Applied only where at least two experts of one routing are masked this way."""
    sites: dict = {}
    for n in [*graph.find_nodes(op="call_function", target=aten.index.Tensor),
              *graph.find_nodes(op="call_function", target=aten.index_put_.default)]:
        idx = n.args[1]
        m = idx[0] if len(idx) == 1 else None
        if is_op(m, {aten.eq.Scalar}) and isinstance(m.args[1], int) and len(shape(m.args[0])) == 1 \
                and val(m.args[0]).dtype in (torch.int64, torch.int32) and shape(m) == shape(n.args[0])[:1]:
            sites.setdefault(m.args[0], {}).setdefault(m.args[1], []).append(n)
    position = {n: i for i, n in enumerate(graph.nodes)}
    for sel, by_id in sites.items():
        if len(by_id) < 2:
            continue
        for eid, users in by_id.items():
            users.sort(key=position.__getitem__)
            gathers = [u for u in users if u.target is aten.index.Tensor]
            if gathers:
                _index_by_rows(graph, sel, eid, users, val(gathers[0]).shape[0])


def _index_by_rows(graph: fx.Graph, sel: fx.Node, eid: int, users: list, count) -> None:
    """Replace the boolean mask ``sel == eid`` of ``users`` by ``where(sel == eid)[0]``, whose size is the
    data-dependent row count ``count`` the gathers already carry."""
    first = users[0]
    with graph.inserting_before(first):
        mask = graph.call_function(aten.eq.Scalar, (sel, eid))
        where = graph.call_function(aten.where.default, (mask,))
        rows = graph.call_function(operator.getitem, (where, 0))
    old_mask = first.args[1][0]
    with val(old_mask).fake_mode:
        rows.meta["val"] = torch.empty((count,), dtype=torch.int64, device=val(old_mask).device)
    mask.meta["val"], where.meta["val"] = val(old_mask), (rows.meta["val"],)
    for n in (mask, where, rows):
        n.meta.update({k: first.meta[k] for k in ("stack_trace", "nn_module_stack") if k in first.meta})
    for u in users:
        old = u.args[1][0]
        u.args = (u.args[0], [rows], *u.args[2:])
        if not old.users:
            graph.erase_node(old)


def from_topk(sel: fx.Node) -> Optional[fx.Node]:
    """The ``topk`` whose indices ``sel`` is (through views), if it is."""
    while is_op(sel, VIEWS):
        sel = sel.args[0]
    if sel.target is operator.getitem and sel.args[1] == 1 and is_op(sel.args[0], {aten.topk.default}):
        return sel.args[0]
    return None
