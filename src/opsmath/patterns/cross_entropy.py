"""Cross-entropy on logits: ``cross_entropy(logits[.float()].view(-1, V), t)`` to ``opsmath::cross_entropy``
(``src/opsmath/kernels/cross_entropy.py``), for the losses ``linear_cross_entropy`` could not take: logits that are
a graph input (Hugging Face GPT-2 computes its loss in a second graph), that come from something other
than a linear layer, or that the model also returns with a slice in the loss.

Anchor: ``aten.cross_entropy_loss`` on 2-D (N, V) input with int64 class targets, no class weights,
reduction mean or sum. Upward through views that keep the class dim last and upcasts (``.float()``),
each with no other user, to the logits in their own dtype, which the op reads directly: their fp32 copy
is never made. Runs after ``linear_cross_entropy`` (which takes the LM-head cases whole).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import VIEWS, aten, dtype, is_cast, is_op, shape
from opsmath.rewrite.match import RewriteContext, node_line
from opsmath.rewrite.rules import register_rule

from opsmath.patterns.linear_cross_entropy import CrossEntropyAnchored, LossArgs

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class CrossEntropyPattern(CrossEntropyAnchored):
    name = "cross_entropy"
    after = ("linear_cross_entropy",)    # takes only the losses linear_cross_entropy left

    def _match(self, ce: fx.Node, args: LossArgs):
        logits = args.logits
        chain, node = [], logits
        while len(node.users) == 1 and (
                (is_op(node, VIEWS) and shape(node) and shape(node)[-1] == shape(node.args[0])[-1])
                or (is_cast(node) and dtype(node.args[0]) in _FLOATS
                    and torch.finfo(dtype(node)).bits >= torch.finfo(dtype(node.args[0])).bits)):
            chain.append(node)
            node = node.args[0]
        if dtype(node) not in _FLOATS:
            return f"logits of dtype {dtype(node)}"
        return args, node, chain

    def _emit(self, ctx: RewriteContext, ce: fx.Node, args: LossArgs, base: fx.Node, chain):
        V = shape(ce.args[0])[1]
        target, reduction, ignore_index, smoothing = args.target, args.reduction, args.ignore_index, args.smoothing
        before = [node_line(n) for n in [*reversed(chain), ce]]
        with ctx.graph.inserting_before(ce):
            z = ctx.call(aten.reshape.default, (base, [-1, V]), ce)
            res = ctx.call(torch.ops.opsmath.cross_entropy.default,
                           (z, target, ignore_index, smoothing, reduction), ce)
            loss = ctx.call(operator.getitem, (res, 0), ce)
            if dtype(ce) != torch.float32:
                loss = ctx.call(aten.to.dtype, (loss, dtype(ce)), ce)
        ce.replace_all_uses_with(loss)
        ctx.erase_dead([ce])
        N = shape(z)[0]
        desc = [f"{N} tokens x {V} classes", reduction, f"read in {str(dtype(base)).replace('torch.', '')}"]
        if smoothing:
            desc.append(f"label_smoothing={smoothing:g}")
        ctx.replaced(self.name, ce, [*chain, ce], f"opsmath::cross_entropy({', '.join(desc)})", before,
                     tokens=N, classes=V, reduction=reduction,
                     dtype=str(dtype(base)).replace("torch.", ""))


PATTERN = register_rule(CrossEntropyPattern())
