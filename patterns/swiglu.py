"""SwiGLU: ``silu(a) * b`` to ``opsmath::swiglu`` (``kernels/swiglu.py``), the gated MLP of LLaMA, Mistral
and Qwen (``down(silu(gate(x)) * up(x))``) and of one fused projection split in two
(``a, b = w(x).chunk(2, -1)``).

Anchor: ``aten.mul.Tensor`` with one operand ``aten.silu`` of a tensor whose shape equals the other
operand's (no broadcasting) and float dtypes. Declines, keeping eager, when silu(a) is also read
elsewhere (it must then exist; the fused op never writes it).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from opsmath.canonicalize import aten, dtype, is_op, shape
from opsmath.match import RewriteContext, node_line
from opsmath.rules import Rule, register_rule

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class SwiGLURule(Rule):
    name = "swiglu"
    anchors = (aten.mul.Tensor,)

    def match(self, ctx: RewriteContext, n: fx.Node):
        if len(n.args) < 2:
            return None
        x, y = n.args[:2]
        if is_op(x, {aten.silu.default}):
            silu, b = x, y
        elif is_op(y, {aten.silu.default}):
            silu, b = y, x
        else:
            return None
        a = silu.args[0]
        if not isinstance(b, fx.Node) or dtype(a) not in _FLOATS or dtype(b) not in _FLOATS:
            return None
        if len(silu.users) != 1:
            return "silu(a) is also read elsewhere, so it must exist"
        if shape(a) != shape(b) or not shape(a):
            return f"silu(a) {shape(a)} and b {shape(b)} broadcast"
        return silu, a, b

    def emit(self, ctx: RewriteContext, mul: fx.Node, plan) -> None:
        silu, a, b = plan
        before = [node_line(silu), node_line(mul)]
        with ctx.graph.inserting_before(mul):
            y = ctx.call(torch.ops.opsmath.swiglu.default, (a, b), mul)
        mul.replace_all_uses_with(y)
        ctx.erase_dead([mul])
        H = shape(a)[-1]
        rows = max(1, int(torch.tensor(shape(a)).prod().item()) // max(H, 1))
        ctx.replaced(self.name, mul, [silu, mul], f"opsmath::swiglu({rows} x {H}, silu recomputed in backward)",
                     before, width=H, rows=rows, dtype=str(dtype(a)).replace("torch.", ""))


PATTERN = register_rule(SwiGLURule())
