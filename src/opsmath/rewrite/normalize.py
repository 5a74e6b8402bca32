"""Graph-wide passes before matching: spellings that hide a pattern from the rules, made plain.

- ``drop_dead_code``: nodes nothing reads, whose absence nobody can observe, are erased, so dead code
  (a debugging ``scores.clone()``) never counts as a reader that blocks a match.
- ``einsums_as_matmuls``: a two-operand ``einsum`` that is a batched matrix product with its letters in
  another order (``"bqhd,bkhd->bhqk"``, attention in (batch, seq, head, dim) layout) becomes
  ``permute -> matmul -> permute``, the product in the ``(..., i, k) @ (..., k, j)`` form every rule reads
  (``canonicalize.as_matmul``). Same arithmetic: ``einsum`` itself permutes and calls ``bmm``.
- ``type_as_casts``: ``x.type_as(t)`` reads ``t`` only for its dtype (fairseq/ESM's
  ``softmax(scores, dtype=float32).type_as(scores)``); as ``x.to(t.dtype)`` it no longer counts as a use of
  ``t`` (the scores), which would block the attention match. Same value; kept where the devices differ.
- ``impossible_masks``: ``x.masked_fill(ids >= E, v)`` where ``ids`` are top-k indices over a dim of size
  ``E`` (through reshapes, sorts and gathers, which keep the values) is ``x``: the mask is false everywhere.
  Hugging Face's grouped experts in transformers 5.17 masked expert-parallel sentinels so on every call,
  three passes over the experts' rows and the masked copies saved for backward (5.18 gates them on
  expert parallelism). Exact: the fill never happens.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import aten, as_matmul, shape


def drop_dead_code(graph: fx.Graph) -> int:
    """Erase the nodes nothing reads whose absence nobody can observe. Kept: anything impure (in-place and
    ``out=`` ops, mutations of inputs, asserts, grad-mode and autocast switches: ``Node.is_impure``), every
    op that draws random numbers (``nondeterministic_seeded``: a dead dropout still advances the generator,
    as in eager) and every call that is not an ATen op. Returns how many were erased."""
    erased = 0
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users or node.is_impure():
            continue
        target = node.target
        if not (isinstance(target, torch._ops.OpOverload) or target is operator.getitem) \
                or torch.Tag.nondeterministic_seeded in getattr(target, "tags", ()):
            continue
        graph.erase_node(node)
        erased += 1
    return erased


def einsums_as_matmuls(ctx) -> int:
    """Rewrite each two-operand einsum that is a permuted batched matmul (``_matmul_letters``); returns
    how many. ``ctx`` is the ``RewriteContext`` (inserted nodes get their fake values)."""
    done = 0
    for node in list(ctx.graph.find_nodes(op="call_function", target=aten.einsum.default)):
        letters = None if as_matmul(node) is not None else _matmul_letters(node)
        if letters is None:
            continue
        (a, b), (sa, sb, out), (batch, i, k, j) = node.args[1], node.args[0].replace(" ", "").replace(
            "->", ",").split(","), letters
        with ctx.graph.inserting_before(node):
            pa = _permuted(ctx, a, sa, batch + i + k, node)
            pb = _permuted(ctx, b, sb, batch + k + j, node)
            y = ctx.call(aten.matmul.default, (pa, pb), node)
            y = _permuted(ctx, y, batch + i + j, out, node)
        node.replace_all_uses_with(y)
        ctx.graph.erase_node(node)
        done += 1
    return done


def _matmul_letters(node: fx.Node) -> Optional[tuple[str, str, str, str]]:
    """``(batch, i, k, j)`` letters when ``node`` is ``einsum(eq, [a, b])`` with ``eq`` a batched matmul in
    any letter order: batch letters in both operands and the output, one ``i`` (a and output), one
    contracted ``k`` (both operands, not the output), one ``j`` (b and output); else None."""
    eq = node.args[0].replace(" ", "") if isinstance(node.args[0], str) else ""
    ops = node.args[1] if len(node.args) > 1 else ()
    if "..." in eq or "->" not in eq or len(ops) != 2 or not all(isinstance(x, fx.Node) for x in ops):
        return None
    lhs, out = eq.split("->")
    if lhs.count(",") != 1:
        return None
    sa, sb = lhs.split(",")
    if any(len(set(s)) != len(s) for s in (sa, sb, out)):
        return None
    batch = "".join(c for c in out if c in sa and c in sb)
    i, k = set(sa) & set(out) - set(sb), set(sa) & set(sb) - set(out)
    j = set(sb) & set(out) - set(sa)
    if len(i) != 1 or len(k) != 1 or len(j) != 1 or len(sa) != len(batch) + 2 or len(sb) != len(batch) + 2 \
            or len(out) != len(batch) + 2:
        return None
    return batch, i.pop(), k.pop(), j.pop()


def _permuted(ctx, x: fx.Node, have: str, want: str, like: fx.Node) -> fx.Node:
    """``x`` with dims labelled ``have`` reordered to ``want`` (``x`` itself when they agree)."""
    if have == want:
        return x
    return ctx.call(aten.permute.default, (x, [have.index(c) for c in want]), like)


def type_as_casts(ctx) -> int:
    """Replace each ``aten.type_as(x, t)`` whose operands share a device with ``aten.to.dtype(x, t.dtype)``;
    returns how many."""
    done = 0
    for node in list(ctx.graph.find_nodes(op="call_function", target=aten.type_as.default)):
        x, t = node.args
        vx, vt = x.meta.get("val"), t.meta.get("val")
        if not (isinstance(vx, torch.Tensor) and isinstance(vt, torch.Tensor)) or vx.device != vt.device:
            continue
        with ctx.graph.inserting_before(node):
            cast = ctx.call(aten.to.dtype, (x, vt.dtype), node)
        node.replace_all_uses_with(cast)
        ctx.graph.erase_node(node)
        done += 1
    return done


# ops whose integer outputs take their values from their first argument's (reordered, selected, repeated)
KEEPS_VALUES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.flatten.using_ints,
                aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.expand.default,
                aten.permute.default, aten.transpose.int, aten.t.default, aten.clone.default,
                aten.contiguous.default, aten.select.int, aten.slice.Tensor, aten.index.Tensor,
                aten.repeat_interleave.self_int, aten.alias.default}
SORTS = {aten.sort.default, aten.sort.stable}
MASK_VIEWS = {aten.unsqueeze.default, aten.expand.default, aten.view.default, aten.reshape.default,
              aten.squeeze.dim, aten.permute.default}
FILLS = {aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Scalar, aten.masked_fill_.Tensor}


def _written(node: fx.Node, before: fx.Node, seen: Optional[set] = None) -> bool:
    """Whether an in-place or ``out=`` op ahead of ``before`` (in graph order) writes ``node`` or a tensor that
    may alias it (its users through ``KEEPS_VALUES``, some of which are views)."""
    seen = set() if seen is None else seen
    if node in seen:
        return False
    seen.add(node)
    for u in node.users:
        if isinstance(u.target, torch._ops.OpOverload) and _writes(u, node) and _ahead(u, before):
            return True
        if u.target in KEEPS_VALUES and u.args and u.args[0] is node and _written(u, before, seen):
            return True
    return False


def _ahead(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a`` runs before ``b`` (both in one graph)."""
    n = a.next
    while n.op != "root":
        if n is b:
            return True
        n = n.next
    return False


def _writes(u: fx.Node, node: fx.Node) -> bool:
    """Whether the op ``u`` writes the argument ``node`` is passed as (``scatter_(dim, index=node)`` reads it)."""
    for i, a in enumerate(u.target._schema.arguments):
        given = u.args[i] if i < len(u.args) else u.kwargs.get(a.name)
        if a.alias_info is not None and a.alias_info.is_write and (
                given is node or isinstance(given, (list, tuple)) and node in given):
            return True
    return False


def index_bound(node, at: fx.Node) -> Optional[int]:
    """An int ``E`` with ``0 <= node < E`` everywhere when ``at`` runs, where ``node`` holds top-k indices over
    a dim of static size ``E`` (``topk(x, k, dim)[1]``) passed through ops that keep values (``KEEPS_VALUES``,
    a sort's values), none of them written in place before ``at``; else None."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if _written(node, at):
            return None
        if node.target in KEEPS_VALUES:
            node = node.args[0]
        elif node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and node.args[0].op == "call_function":
            src, i = node.args
            if src.target in SORTS and i == 0:
                node = src.args[0]
            elif src.target is aten.topk.default and i == 1:
                dim = src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", -1)
                size = shape(src.args[0])[dim] if shape(src.args[0]) else None
                return size if isinstance(size, int) else None
            else:
                return None
        else:
            return None
    return None


def _never(mask, fill: fx.Node) -> bool:
    """Whether the bool tensor ``mask`` is provably false everywhere when ``fill`` reads it: ``ids >= c`` /
    ``ids > c`` at or past the indices' bound, ``ids < 0``, seen through views, none written in place."""
    while isinstance(mask, fx.Node) and mask.op == "call_function" and mask.target in MASK_VIEWS \
            and not _written(mask, fill):
        mask = mask.args[0]
    if not (isinstance(mask, fx.Node) and mask.op == "call_function" and len(mask.args) == 2) \
            or _written(mask, fill):
        return False
    ids, c = mask.args
    if isinstance(c, bool) or not isinstance(c, int):
        return False
    if mask.target is aten.lt.Scalar:
        return c <= 0 and index_bound(ids, mask) is not None
    bound = index_bound(ids, mask) if mask.target in (aten.ge.Scalar, aten.gt.Scalar) else None
    return bound is not None and (c >= bound if mask.target is aten.ge.Scalar else c >= bound - 1)


def impossible_masks(graph: fx.Graph) -> int:
    """Replace each ``masked_fill(x, mask, v)`` (in place or not) whose mask is false everywhere (``_never``)
    by ``x`` itself; returns how many. The masks' own ops are left to ``drop_dead_code``, which ``normalize``
    runs next."""
    done = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in FILLS]:
        x, mask = node.args[0], node.args[1]
        if not _never(mask, node):
            continue
        node.replace_all_uses_with(x)
        graph.erase_node(node)
        done += 1
    return done
