"""Scaled / masked softmax outside attention: ``softmax(x * c + bias)``, ``softmax(x / T)``,
``softmax(x.masked_fill(mask, -inf))`` over the last dim, to ``opsmath::scaled_softmax``
(``src/opsmath/kernels/softmax.py``): one pass forward and one backward instead of a scale, an add and the softmax
each writing a tensor. Attention's own softmax is taken whole by the attention pattern, which runs
first; what is left are routers, temperature-scaled distributions and attention probabilities that are
returned (``output_attentions``) or otherwise read, so attention could not be fused.

Anchor: ``aten.softmax`` / ``aten._softmax`` on the last dim. Upward: an optional additive tensor that
broadcasts to the scores or a ``masked_fill`` with -inf (becoming an additive bias on the mask's own
shape; a finite fill is not additive, so it is left alone), then scalar multiplications or divisions. A plain softmax is left alone
(it is one kernel already). Each intermediate must have no other reader.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import SOFTMAXES, aten, dtype, is_op, shape, strip_scales
from opsmath.rewrite.match import RewriteContext, node_line
from opsmath.rewrite.rules import Rule, register_rule

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _broadcasts_to(small: tuple, big: tuple) -> bool:
    try:
        return torch.broadcast_shapes(small, big) == big
    except RuntimeError:
        return False


class ScaledSoftmaxRule(Rule):
    name = "scaled_softmax"
    anchors = tuple(SOFTMAXES)
    after = ("attention",)    # takes the softmaxes attention left

    def match(self, ctx: RewriteContext, n: fx.Node):
        z = n.args[0]
        dim = n.args[1]
        if not isinstance(z, fx.Node) or dtype(z) not in _FLOATS or not 1 <= len(shape(z)) <= 4 \
                or dim not in (-1, len(shape(z)) - 1):
            return None
        if is_op(n, {aten._softmax.default}) and n.args[2]:
            return None   # half_to_float: the output dtype differs from the input's
        found = self._match(z)
        if found is None or (not isinstance(found, str) and dtype(n) != dtype(found[0])):
            return None   # softmax(..., dtype=...) converts: the fused op keeps its input's dtype
        return found

    def emit(self, ctx: RewriteContext, n: fx.Node, plan) -> None:
        self._emit(ctx, n, *plan)

    @staticmethod
    def _match(z: fx.Node):
        """(x, bias or (mask, fill) or None, scale, nodes replaced) or a reason, or None."""
        chain, bias, node = [], None, z
        if is_op(node, {aten.add.Tensor}) and len(node.args) == 2 and not node.kwargs:
            a, b = node.args
            if isinstance(a, fx.Node) and isinstance(b, fx.Node):
                if shape(a) == shape(node) and _broadcasts_to(shape(b), shape(node)) and dtype(b) in _FLOATS:
                    bias, node = b, a
                elif shape(b) == shape(node) and _broadcasts_to(shape(a), shape(node)) and dtype(a) in _FLOATS:
                    bias, node = a, b
            if bias is not None:
                chain.append(z)
        elif is_op(node, {aten.masked_fill.Scalar}) and isinstance(node.args[1], fx.Node):
            fill = node.args[2]
            # only -inf: a finite fill sets the score (a fully masked row becomes uniform), which an
            # additive bias would not reproduce
            if isinstance(fill, (int, float)) and fill == float("-inf") and \
                    _broadcasts_to(shape(node.args[1]), shape(node)):
                bias, node = (node.args[1], float(fill)), node.args[0]
                chain.append(z)
        x, scale = strip_scales(node)
        walked = node
        while walked is not x:
            chain.append(walked)
            walked = walked.args[0] if isinstance(walked.args[0], fx.Node) else walked.args[1]
        if not chain:
            return None      # a plain softmax: already one kernel
        if any(len(c.users) != 1 for c in chain):
            return "an intermediate of the scaled scores is also read elsewhere, so it must exist"
        if shape(x) != shape(z) or dtype(x) not in _FLOATS:
            return None
        return x, bias, scale, chain

    def _emit(self, ctx: RewriteContext, sm: fx.Node, x: fx.Node, bias, scale: float, chain: list) -> None:
        before = [node_line(m) for m in [*reversed(chain), sm]]
        with ctx.graph.inserting_before(sm):
            if isinstance(bias, tuple):     # masked_fill(mask, fill) -> additive bias on the mask's shape
                mask, fill = bias
                zeros = ctx.call(aten.zeros_like.default, (mask,), sm, {"dtype": dtype(x)})
                bias = ctx.call(aten.masked_fill.Scalar, (zeros, mask, fill), sm)
                how = "mask"
            else:
                how = "bias" if bias is not None else ""
            y = ctx.call(torch.ops.opsmath.scaled_softmax.default, (x, bias, scale), sm)
        sm.replace_all_uses_with(y)
        ctx.erase_dead([sm])
        desc = [f"{shape(x)[-1]} wide"] + ([f"scale={scale:g}"] if scale != 1.0 else []) + ([how] if how else [])
        ctx.replaced(self.name, sm, [*chain, sm], f"opsmath::scaled_softmax({', '.join(desc)})", before,
                     width=shape(x)[-1], scale=scale, bias=how or None)


PATTERN = register_rule(ScaledSoftmaxRule())
