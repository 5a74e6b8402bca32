"""Bias-GELU: ``gelu(linear(x, W, b))`` or ``gelu(h + b)``, optionally followed by dropout (timm's
``Mlp``: fc1 -> act -> drop), to ``linear(x, W)`` (no bias) + ``opsmath::bias_gelu`` (``kernels/bias_gelu.py``),
whose backward gives dx and the bias gradient in one pass and regenerates the dropout mask.

Anchor: ``aten.gelu`` (erf or tanh form) whose input is a ``linear`` with a bias, or an ``add`` of a 1-D
tensor as wide as the last dim, with the GELU as its only reader; then a ``dropout`` that is the GELU's only
reader joins the op. Declines when the pre-activation is read elsewhere (it must then exist).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from opsmath.canonicalize import aten, dropout_info, dtype, is_op, shape
from opsmath.match import RewriteContext, node_line

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class BiasGeluPattern:
    name = "bias_gelu"

    def apply(self, ctx: RewriteContext) -> None:
        for n in list(ctx.graph.nodes):
            if getattr(n, "_erased", False) or not is_op(n, {aten.gelu.default}):
                continue
            found = self._match(n)
            if found is None:
                continue
            if isinstance(found, str):
                ctx.declined(self.name, n, found)
            elif not ctx.allowed(self.name, n):
                ctx.declined(self.name, n, "skipped by the user")
            else:
                self._emit(ctx, n, *found)

    @staticmethod
    def _match(gelu: fx.Node):
        """(pre-activation node, x or h, W or None, bias) or a reason to decline, or None (no bias)."""
        h = gelu.args[0]
        if is_op(h, {aten.linear.default}) and len(h.args) > 2 and h.args[2] is not None:
            x, w, b = h.args[:3]
        elif is_op(h, {aten.add.Tensor}) and len(h.args) == 2 and h.kwargs.get("alpha", 1) == 1:
            x, b = h.args
            if not isinstance(b, fx.Node) or len(shape(b)) != 1:
                x, b = b, x
            w = None
            if not isinstance(b, fx.Node) or len(shape(b)) != 1 or shape(b)[0] != shape(h)[-1] \
                    or shape(x) != shape(h):
                return None
        else:
            return None
        if dtype(h) not in _FLOATS:
            return None
        if len(h.users) != 1:
            return "the pre-activation is also read elsewhere, so it must exist"
        return h, x, w, b

    def _emit(self, ctx: RewriteContext, gelu: fx.Node, h: fx.Node, x: fx.Node, w, b: fx.Node) -> None:
        approximate = gelu.kwargs.get("approximate", gelu.args[1] if len(gelu.args) > 1 else "none")
        drop, p = None, 0.0
        if len(gelu.users) == 1:
            d = next(iter(gelu.users))
            info = dropout_info(d)
            if info is not None and info[0] is gelu:
                drop, p = d, info[1]
        out = drop or gelu
        before = [node_line(m) for m in (h, gelu, drop) if m is not None]
        with ctx.graph.inserting_before(gelu):
            pre = ctx.call(aten.linear.default, (x, w), h) if w is not None else x
            if p > 0:
                from opsmath.kernels._common import new_seed
                seed = ctx.call(new_seed, (), gelu)
            else:
                seed = ctx.call(aten.scalar_tensor.default, (0,), gelu, {"dtype": torch.int64})
            y = ctx.call(torch.ops.opsmath.bias_gelu.default, (pre, b, approximate, p, seed), gelu)
        out.replace_all_uses_with(y)
        ctx.erase_dead([out])
        desc = [f"{shape(h)[-1]} wide", approximate if approximate == "tanh" else "erf"]
        if drop is not None:
            desc.append(f"dropout={p:g}" if p else "dropout off")
        ctx.replaced(self.name, gelu, [m for m in (h, gelu, drop) if m is not None],
                     f"{'linear without bias + ' if w is not None else ''}opsmath::bias_gelu({', '.join(desc)})",
                     before, width=shape(h)[-1], approximate=approximate, dropout_p=p,
                     dtype=str(dtype(h)).replace("torch.", ""))


PATTERN = BiasGeluPattern()
