"""Bias-GELU: ``gelu(linear(x, W, b))``, ``gelu(addmm(b, x, W))`` (HF GPT-2's ``Conv1D``) or
``gelu(h + b)``, optionally followed by dropout (timm's ``Mlp``: fc1 -> act -> drop), to the GEMM without
its bias + ``opsmath::bias_gelu`` (``src/opsmath/kernels/bias_gelu.py``), whose backward gives dx and the bias gradient
in one pass and regenerates the dropout mask.

Anchor: ``aten.gelu`` (erf or tanh form), or the tanh form written out in elementwise ops (HF's
``gelu_new``: ``0.5 * h * (1 + tanh(sqrt(2/pi) * (h + 0.044715 * h**3)))``), whose input is one of the
biased GEMMs above or an ``add`` of a 1-D tensor as wide as the last dim, read by nothing else; then a
``dropout`` that is the GELU's only reader joins the op. Declines when the pre-activation is read
elsewhere (it must then exist).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import aten, dropout_info, dtype, is_op, shape
from opsmath.rewrite.declare import find, trace_pattern
from opsmath.rewrite.match import RewriteContext, node_line
from opsmath.rewrite.rules import Rule, register_rule

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# Hugging Face's ``NewGELUActivation`` (``gelu_new``, GPT-2), written out in elementwise ops
_SPELLED = trace_pattern(
    lambda h: 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0)))))


def spelled_tanh_gelu(node):
    """(h, nodes, result first) if ``node`` computes ``0.5 * h * (1 + tanh(sqrt(2/pi) * (h + 0.044715 *
    h**3)))`` in any operand order of its adds and multiplies (``declare.find``)."""
    m = find(_SPELLED, node)
    return None if m is None else (m["h"], list(reversed(m.nodes)))


def _feeds_gemms(node, depth: int = 4) -> bool:
    """Whether every reader of ``node`` (through views) is a GEMM. Under CUDA autocast the written-out
    GELU's ``pow`` runs in fp32, so eager's result is fp32 where the fused op's is the GEMM's dtype; a GEMM
    reader casts it back under autocast either way, so only then is the rewrite the same function."""
    gemms = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default, aten.bmm.default}
    views = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
    return bool(node.users) and depth > 0 and all(
        is_op(u, gemms) or (is_op(u, views) and _feeds_gemms(u, depth - 1)) for u in node.users)


class BiasGeluRule(Rule):
    name = "bias_gelu"
    anchors = (aten.gelu.default, aten.mul.Tensor)   # the library op, or the last mul of the spelled form
    after = ("dropout_add_norm", "experts")   # a dropout both could take goes with the residual add
    # and norm; inside an expert, the grouped rows (static sizes) are what it can fuse

    def match(self, ctx: RewriteContext, n: fx.Node):
        if is_op(n, {aten.gelu.default}):
            approximate = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
            h, inner = n.args[0], [n]
        else:
            spelled = spelled_tanh_gelu(n)
            if spelled is None or not _feeds_gemms(n):
                return None
            (h, inner), approximate = spelled, "tanh"
        found = self._bias_of(h, set(inner))
        return found if found is None or isinstance(found, str) else (inner, approximate, *found)

    def emit(self, ctx: RewriteContext, n: fx.Node, plan) -> None:
        self._emit(ctx, n, *plan)

    @staticmethod
    def _bias_of(h: fx.Node, inner: set):
        """(pre-activation nodes, how, operands, bias) or a reason to decline, or None (no bias).
        ``how``: "linear" (x, W), "addmm" (x2d, W, view shape or None) or "add" (h0)."""
        view = None
        if is_op(h, {aten.view.default, aten.reshape.default}) and is_op(h.args[0], {aten.addmm.default}) \
                and shape(h)[-1:] == shape(h.args[0])[-1:]:
            view, mm = h, h.args[0]
        else:
            mm = h
        if is_op(h, {aten.linear.default}) and len(h.args) > 2 and h.args[2] is not None:
            pre, how, ops, b = [h], "linear", h.args[:2], h.args[2]
        elif is_op(mm, {aten.addmm.default}) and mm.kwargs.get("beta", 1) == 1 and mm.kwargs.get("alpha", 1) == 1 \
                and len(shape(mm.args[0])) == 1:
            pre, how, ops, b = [mm] + ([view] if view is not None else []), "addmm", \
                (mm.args[1], mm.args[2], list(shape(view)) if view is not None else None), mm.args[0]
        elif is_op(h, {aten.add.Tensor}) and len(h.args) == 2 and h.kwargs.get("alpha", 1) == 1:
            x, b = h.args
            if not isinstance(b, fx.Node) or len(shape(b)) != 1:
                x, b = b, x
            if not isinstance(b, fx.Node) or len(shape(b)) != 1 or shape(b)[0] != shape(h)[-1] \
                    or shape(x) != shape(h) or dtype(x) != dtype(h):
                return None   # a broadcasting or dtype-promoting add is not this op
            pre, how, ops = [h], "add", (x,)
        else:
            return None
        if dtype(h) not in _FLOATS:
            return None
        if any(u not in inner for u in h.users) or any(len(m.users) != 1 for m in pre[:-1]):
            return "the pre-activation is also read elsewhere, so it must exist"
        return pre, how, ops, b

    def _emit(self, ctx: RewriteContext, out: fx.Node, inner: list, approximate: str, pre: list, how: str,
              ops, b: fx.Node) -> None:
        drop, p = None, 0.0
        if len(out.users) == 1:
            d = next(iter(out.users))
            info = dropout_info(d)
            if info is not None and info[0] is out:
                drop, p = d, info[1]
        last = drop or out
        h = pre[-1]
        replaced = [*pre, *reversed(inner)] + ([drop] if drop is not None else [])
        before = [node_line(m) for m in replaced]
        with ctx.graph.inserting_before(out):
            if how == "linear":
                x = ctx.call(aten.linear.default, tuple(ops), h)
            elif how == "addmm":
                x = ctx.call(aten.mm.default, tuple(ops[:2]), h)
                if ops[2] is not None:
                    x = ctx.call(aten.view.default, (x, ops[2]), h)
            else:
                x = ops[0]
            seed = ctx.dropout_seed(p, x, out)
            y = ctx.call(torch.ops.opsmath.bias_gelu.default, (x, b, approximate, p, seed), out)
        last.replace_all_uses_with(y)
        ctx.erase_dead([last])
        desc = [f"{shape(h)[-1]} wide", approximate if approximate == "tanh" else "erf"]
        if len(inner) > 1:
            desc.append("spelled out")
        if drop is not None:
            desc.append(f"dropout={p:g}" if p else "dropout off")
        head = {"linear": "linear without bias + ", "addmm": "mm + "}.get(how, "")
        ctx.replaced(self.name, out, replaced, f"{head}opsmath::bias_gelu({', '.join(desc)})", before,
                     width=shape(h)[-1], approximate=approximate, dropout_p=p, spelled_out=len(inner) > 1,
                     dtype=str(dtype(h)).replace("torch.", ""))


PATTERN = register_rule(BiasGeluRule())
