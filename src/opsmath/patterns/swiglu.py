"""SwiGLU: ``silu(a) * b`` to ``opsmath::swiglu`` (``src/opsmath/kernels/swiglu.py``), the gated MLP of LLaMA, Mistral
and Qwen (``down(silu(gate(x)) * up(x))``) and of one fused projection split in two
(``a, b = w(x).chunk(2, -1)``).

Written as a pattern (``src/opsmath/rewrite/declare.py``): ``silu(a) * b`` in either operand order, float
dtypes, a and b of one shape (no broadcasting). Declines, keeping eager, when silu(a) is also read
elsewhere (it must then exist; the fused op never writes it).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from opsmath.rewrite.canonicalize import dtype, shape
from opsmath.rewrite.declare import PatternMatch, PatternRule
from opsmath.rewrite.rules import register_rule

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class SwiGLURule(PatternRule):
    name = "swiglu"
    patterns = (lambda a, b: F.silu(a) * b,)
    read_elsewhere = "silu(a) is also read elsewhere, so it must exist"

    def check(self, ctx, m: PatternMatch):
        a, b = m["a"], m["b"]
        if dtype(a) not in _FLOATS or dtype(b) not in _FLOATS:
            return None
        if shape(a) != shape(b) or not shape(a):
            return f"silu(a) {shape(a)} and b {shape(b)} broadcast"
        return True

    def replacement(self, ctx, m: PatternMatch):
        return torch.ops.opsmath.swiglu.default, (m["a"], m["b"])

    def describe(self, m: PatternMatch):
        a = m["a"]
        H = shape(a)[-1]
        rows = max(1, math.prod(shape(a)) // max(H, 1))
        return (f"opsmath::swiglu({rows} x {H}, silu recomputed in backward)",
                dict(width=H, rows=rows, dtype=str(dtype(a)).replace("torch.", "")))


PATTERN = register_rule(SwiGLURule())
