"""The report's contract: every subgraph that looks like a family's candidate is rewritten or declined.

After the rules ran, the rewritten graph is walked for what is still there and looks like work a family
fuses; each such node that no rule declined gets a declined row saying it was not recognized, so a spelling
the rules do not read (a model library's own idiom) is visible in the report instead of silently kept:

- attention: a last-dim softmax whose probabilities reach a matmul (through casts, dropout and views);
- dropout_add_norm: a norm over the last dim (``layer_norm``, ``rms_norm``, an ``rsqrt`` of a mean of
  squares, ``F.normalize``'s vector norm) whose input, through casts and views, is an ``add`` of two
  tensors of its shape (a residual sum);
- cross_entropy: a ``cross_entropy_loss`` or ``nll_loss``, or a last-dim ``log_softmax`` read by a
  ``gather`` (a hand-written loss);
- swiglu: a gated MLP's activation left as written: ``silu`` or ``gelu`` of a linear whose result is
  multiplied by another tensor of its shape (GEGLU: the fused op is silu-gated).
Families the user skipped or left to Inductor are not walked for.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import MATMULS, SOFTMAXES, VIEWS, aten, dropout_info, is_cast, is_op, shape

_NORMS = {aten.layer_norm.default, aten.rms_norm.default, aten.rsqrt.default, aten.linalg_vector_norm.default}
_SPLITS = {aten.split.Tensor, aten.chunk.default, aten.split_with_sizes.default, aten.unbind.int}
_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default}


def flag_unmatched(ctx, families: set) -> None:
    """Append a declined row for each candidate of ``families`` left in ``ctx``'s graph with none yet."""
    declined = {d.node for d in ctx.declines} | ctx.put_back
    for node in ctx.graph.nodes:
        if node.op != "call_function" or node.name in declined:
            continue
        found = _candidate(node)
        if found is not None and found[0] in families:
            ctx.declined(found[0], node, f"not recognized ({found[1]}): left as written")


def _candidate(node: fx.Node):
    """``(family, what)`` when ``node`` looks like a family's candidate, else None."""
    if is_op(node, SOFTMAXES) and _last_dim(node, node.args[1]) and _reaches_matmul(node):
        return "attention", "a softmax over the last dim feeding a matmul"
    if is_op(node, _NORMS) and _norm_over_residual(node):
        return "dropout_add_norm", f"{node.target.__name__.split('.')[0]} over the last dim of a residual sum"
    if is_op(node, _LOSSES):
        return "cross_entropy", f"{node.target.__name__.split('.')[0]} over logits"
    if is_op(node, {aten.log_softmax.int, aten._log_softmax.default}) and _last_dim(node, node.args[1]) \
            and any(is_op(u, {aten.gather.default}) for u in _through(node)):
        return "cross_entropy", "log_softmax over the classes, picked by gather (a hand-written loss)"
    if is_op(node, {aten.silu.default, aten.gelu.default}) and _gates(node):
        act = node.target.__name__.split('.')[0]
        return "swiglu", f"{act}-gated product of two projections" + ("; the fused op is silu-gated" * (act == "gelu"))
    return None


def _gates(node: fx.Node) -> bool:
    """``act(x) * y`` with ``y`` of the activation's shape, ``x`` a linear's or matmul's output (or a chunk of
    one: a fused gate-and-up projection)."""
    x = _source(node.args[0])
    if x.target is operator.getitem and is_op(x.args[0], _SPLITS):
        x = _source(x.args[0].args[0])
    if not is_op(x, MATMULS | {aten.linear.default}):
        return False
    return any(is_op(u, {aten.mul.Tensor}) and all(isinstance(t, fx.Node) and t.meta.get("val") is not None
                                                  and shape(t) == shape(node) for t in u.args)
               for u in _through(node))


def _last_dim(node: fx.Node, dim) -> bool:
    nd = len(shape(node))
    return isinstance(dim, int) and nd > 0 and dim % nd == nd - 1


def _through(node: fx.Node) -> list[fx.Node]:
    """The readers of ``node``, looking through casts, views, dropout and transposes."""
    out, todo, seen = [], list(node.users), set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        if is_cast(u) or is_op(u, VIEWS | {aten.transpose.int, aten.permute.default}) or dropout_info(u):
            todo.extend(u.users)
        else:
            out.append(u)
    return out


def _reaches_matmul(node: fx.Node) -> bool:
    return any(is_op(u, MATMULS | {aten.einsum.default, aten.baddbmm.default}) for u in _through(node))


def _source(node) -> fx.Node:
    """``node`` with casts and views stripped from its input side."""
    while isinstance(node, fx.Node) and (is_cast(node) or is_op(node, VIEWS)):
        node = node.args[0]
    return node


def _norm_over_residual(node: fx.Node) -> bool:
    """A norm's input (for ``rsqrt``: the mean of squares' operand) is a residual sum."""
    x = node.args[0]
    if is_op(node, {aten.rsqrt.default}):   # rsqrt(mean(h * h | h ** 2, -1) + eps)
        add = x if is_op(x, {aten.add.Tensor}) else None
        mean = next((a for a in (add.args if add is not None else ()) if is_op(a, {aten.mean.dim})), None)
        sq = mean.args[0] if mean is not None else None
        if not is_op(sq, {aten.pow.Tensor_Scalar, aten.mul.Tensor}):
            return False
        x = sq.args[0]
    elif is_op(node, {aten.linalg_vector_norm.default}):
        dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if not (isinstance(dims, (list, tuple)) and len(dims) == 1 and _last_dim(node.args[0], dims[0])):
            return False
    h = _source(x)
    if not is_op(h, {aten.add.Tensor}) or len(h.args) != 2:
        return False
    a, b = h.args
    return all(isinstance(t, fx.Node) and isinstance(t.meta.get("val"), torch.Tensor) and shape(t) == shape(h)
               for t in (a, b))
