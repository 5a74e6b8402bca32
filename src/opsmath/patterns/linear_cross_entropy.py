"""Linear-cross-entropy: an LM head's ``cross_entropy(linear(x, W, b) [.float()] .view(-1, V), t)`` to
``opsmath::linear_cross_entropy`` (``src/opsmath/kernels/linear_cross_entropy.py``), which never materializes the
(tokens x vocab) logits, their fp32 copy, log-softmax or gradient.

Anchor: ``aten.cross_entropy_loss`` on 2-D (N, V) input. Walking up from it through views that keep
the class dim last, row slices (HF's ``logits[:, :-1]`` shift), ``contiguous`` and dtype casts, each
with no other user, must reach an ``aten.linear`` whose only user is that chain. The views and slices
are replayed on the linear's input x, so only the rows the loss reads are computed. A final-logit
softcap between the linear and those views (Gemma-2's ``c * tanh(logits / c)``, casts allowed under it)
goes into the op as its ``softcap``. Declined (left alone, with the reason in the report): class
weights, ``reduction='none'``, (N, V, ...) inputs, a cast or view of the logits that something else
reads, the logits under a softcap read by anything else.
When the model also returns the logits themselves (Hugging Face's ``CausalLMOutput.logits``), the op
returns them too, in the compute dtype: the fp32 copy, log-softmax and gradient still never exist
whole (declined if the loss reads a slice of them or something reads them before the loss).

The linear's compute dtype (bf16 under autocast) is kept: x, W and b are cast to it explicitly, since
a custom op sees autocast's inputs uncast. The gradients are computed in the forward when any of x, W,
b can need one and grad mode is on at capture; an inference graph computes the loss only.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import VIEWS, aten, dtype, is_cast, is_op, scalar_scale, shape, strip_scales
from opsmath.rewrite.match import RewriteContext, node_line
from opsmath.rewrite.rules import Rule, register_rule

_REDUCTIONS = {1: "mean", 2: "sum"}
_ROW_OPS = {aten.slice.Tensor, aten.contiguous.default}   # row selection (HF's shift) and copies


def _arg(node: fx.Node, i: int, name: str, default):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


@dataclass
class LossArgs:
    """What a fused cross-entropy needs from an ``aten.cross_entropy_loss`` node."""
    logits: fx.Node             # (N, V)
    target: fx.Node             # (N,) int64
    reduction: str              # "mean" | "sum"
    ignore_index: int
    smoothing: float


class CrossEntropyAnchored(Rule):
    """What both cross-entropy families share: the anchor ``aten.cross_entropy_loss``, its arguments
    checked once (``loss_args``), then the family's ``_match`` and ``_emit``."""
    anchors = (aten.cross_entropy_loss.default,)

    def match(self, ctx: RewriteContext, n: fx.Node):
        found = loss_args(n)
        return found if isinstance(found, str) else self._match(n, found)

    def emit(self, ctx: RewriteContext, n: fx.Node, plan) -> None:
        self._emit(ctx, n, *plan)


def loss_args(ce: fx.Node):
    """``LossArgs`` of a cross-entropy either family can fuse, or why not."""
    logits, target = ce.args[0], ce.args[1]
    if _arg(ce, 2, "weight", None) is not None:
        return "class weights are not supported"
    reduction = _arg(ce, 3, "reduction", 1)
    if reduction not in _REDUCTIONS:
        return "reduction='none' needs the per-token losses"
    if len(shape(logits)) != 2 or not isinstance(target, fx.Node) or len(shape(target)) != 1:
        return f"input of shape {shape(logits)}: only (tokens, classes) is fused"
    if dtype(target) != torch.int64:
        return "only class-index (int64) targets are fused"
    if dtype(logits) == torch.float64:
        return "float64 logits: the fused loss computes in fp32"
    return LossArgs(logits, target, _REDUCTIONS[reduction], int(_arg(ce, 4, "ignore_index", -100)),
                    float(_arg(ce, 5, "label_smoothing", 0.0)))


def _walk_rows(node: fx.Node, below: fx.Node):
    """From the loss's logits up through views that keep the classes last, row slices, copies and casts
    (each read only by the node below it, ``below`` for the first): (the nodes passed, loss side first;
    the node reached; readers of an identity cast on it, as (reader, cast)), or (a reason, None, None)."""
    chain, readers = [], []
    while is_op(node, VIEWS | _ROW_OPS) or is_cast(node):
        if len(node.users) != 1:
            if not (is_cast(node) and dtype(node) == dtype(node.args[0])
                    and (is_op(node.args[0], {aten.linear.default}) or softcap_of(node.args[0]))):
                return "a cast or view of the logits is used elsewhere, so it must exist whole", None, None
            # an identity cast (``.float()`` of fp32 logits) is the logits: its readers are theirs
            readers += [(u, node) for u in node.users if u is not (chain[-1] if chain else below)]
        if is_op(node, {aten.slice.Tensor}) and \
                (node.args[1] if len(node.args) > 1 else 0) % len(shape(node)) == len(shape(node)) - 1:
            return "the logits are sliced along the classes", None, None
        if is_op(node, VIEWS) and (not shape(node) or shape(node)[-1] != shape(node.args[0])[-1]):
            return "a view mixes the class dim with the rows", None, None
        chain.append(node)
        node = node.args[0]
    return chain, node, readers


def softcap_of(node):
    """(c, z, [nodes, output first]) if ``node`` computes ``c * tanh(z / c)`` (Gemma-2's final logit
    softcapping, in any order of its scalar scales, ``z * (1 / c)`` too), else None."""
    if not isinstance(node, fx.Node):
        return None
    outer, m = strip_scales(node)
    if not is_op(outer, {aten.tanh.default}) or outer is node:
        return None
    z, a = strip_scales(outer.args[0])
    if z is outer.args[0] or m <= 0 or abs(a * m - 1) > 1e-6:
        return None
    nodes, n = [], node
    while n is not z:   # the scale nodes and the tanh, output first
        nodes.append(n)
        n = n.args[0] if n is outer else scalar_scale(n)[0]
    return m, z, nodes


class LinearCrossEntropyPattern(CrossEntropyAnchored):
    name = "linear_cross_entropy"

    def _match(self, ce: fx.Node, args: LossArgs):
        chain, node, readers = _walk_rows(args.logits, ce)
        if isinstance(chain, str):
            return chain
        cap, src = 0.0, node   # src: the logits the model sees (softcapped ones where capped)
        loss_path = chain[-1] if chain else ce   # what reads src on the way to the loss
        if (found := softcap_of(node)) is not None:
            cap, node, capping = found
            if any(len(n.users) != 1 for n in capping[1:]):
                return "an intermediate of the logits' softcap is used elsewhere"
            lower, node, lower_readers = _walk_rows(node, capping[-1])
            if isinstance(lower, str) or lower_readers or any(len(n.users) != 1 for n in lower):
                return "the logits under the softcap are read elsewhere or mixed with the rows"
            if any(not is_cast(n) for n in lower):
                return "the logits are reshaped under the softcap"
            chain = chain + capping + lower
        lin = node
        if not is_op(lin, {aten.linear.default}):
            return "the logits do not come from a linear layer"
        if dtype(lin) == torch.float64:
            return "a float64 linear: the fused loss computes in fp32"
        if cap and len(lin.users) != 1:
            return "the logits before the softcap are used elsewhere"
        others = [(u, src) for u in src.users if u is not loss_path] + readers
        if others:   # the model also returns (or reads) the logits: the op returns them too
            if any(is_op(n, {aten.slice.Tensor}) for n in chain):
                return "the logits are used elsewhere and the loss reads a slice of them"
            order = {n: i for i, n in enumerate(ce.graph.nodes)}
            if any(order[u] < order[ce] for u, _ in others):
                return "the logits are read before the loss is computed"
        x, w = lin.args[0], lin.args[1]
        b = lin.args[2] if len(lin.args) > 2 else None
        V = shape(args.logits)[1]
        if len(shape(w)) != 2 or shape(w)[0] != V or not shape(x):
            return f"the linear's weight {shape(w)} does not give the {V} classes"
        return args, lin, x, w, b, chain, others, cap

    def _emit(self, ctx, ce, args: LossArgs, lin, x, w, b, chain, others, cap):
        cdt = dtype(lin)
        target, reduction, ignore_index, smoothing = args.target, args.reduction, args.ignore_index, args.smoothing
        compute_grad = torch.is_grad_enabled() and any(
            t is not None and ctx.may_require_grad(t) for t in (x, w, b))
        before = [node_line(n) for n in [lin, *reversed(chain), ce]]
        with ctx.graph.inserting_before(ce):
            def cast(t):
                return ctx.cast(t, cdt, ce)
            rows = cast(x)
            for op in reversed(chain):   # the rows' views and slices, replayed on x instead of logits
                if is_op(op, {aten.slice.Tensor}):
                    rows = ctx.call(aten.slice.Tensor, (rows, *op.args[1:]), ce, dict(op.kwargs))
                elif is_op(op, VIEWS):
                    rows = ctx.call(aten.reshape.default, (rows, [*shape(op)[:-1], shape(x)[-1]]), ce)
            x2 = ctx.call(aten.reshape.default, (rows, [-1, shape(x)[-1]]), ce)
            res = ctx.call(torch.ops.opsmath.linear_cross_entropy.default,
                           (x2, cast(w), cast(b), target, ignore_index, smoothing, reduction, compute_grad,
                            bool(others), cap), ce)
            loss = ctx.call(operator.getitem, (res, 0), ce)
            if others:   # the logits the model sees: the softcapped ones, in their dtype
                read = others[0][1]
                logits = ctx.cast(ctx.call(aten.view.default, (ctx.call(operator.getitem, (res, 4), ce),
                                                               list(shape(read))), ce), dtype(read), ce)
            if dtype(ce) != torch.float32:
                loss = ctx.call(aten.to.dtype, (loss, dtype(ce)), ce)
        ce.replace_all_uses_with(loss)
        for u, read in others:
            u.replace_input_with(read, logits)
        ctx.erase_dead([ce])
        N, V = shape(x2)[0], shape(w)[0]
        desc = [f"{N} tokens x {V} classes", reduction]
        if smoothing:
            desc.append(f"label_smoothing={smoothing:g}")
        if cap:
            desc.append(f"softcap={cap:g}")
        if not compute_grad:
            desc.append("loss only")
        if others:
            desc.append("logits returned")
        ctx.replaced(self.name, ce, [lin, *chain, ce], f"opsmath::linear_cross_entropy({', '.join(desc)})",
                     before, tokens=N, classes=V, reduction=reduction, compute_grad=compute_grad,
                     dtype=str(cdt).replace("torch.", ""), logits_bytes=4 * N * V, returns_logits=bool(others),
                     softcap=cap)


PATTERN = register_rule(LinearCrossEntropyPattern())
