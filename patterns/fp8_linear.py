"""FP8 linear layers (``optimize(model, fp8=True)``): ``linear(x, W[, b])`` to ``kernels.fp8_linear``,
FP8 GEMMs forward and backward with tensorwise dynamic scaling, where FP8 pays.

Anchor: ``aten.linear.default`` whose weight is a graph input (a parameter), x and W in bf16, K and N
multiples of 16. Per layer, by measured shape (docs/anchors ``fp8_gemm``, H200): FP8 GEMMs are 1.38-1.84x
bf16 from K, N >= 2048 at 8192 rows, 1.19x at 768 -> 3072, and the casts cost a share that shrinks with
size; a GEMM with K, N or the row count below ``MIN_DIM`` stays bf16, and the report says so per layer.
Opt-in: applied only when ``optimize(..., fp8=True)`` (FP8 changes numerics beyond the tolerance rule).
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx

from opsmath.canonicalize import aten, dtype, shape, size_hint, val
from opsmath.kernels.fp8_linear import fp8_linear
from opsmath.match import RewriteContext, node_line
from opsmath.rules import Rule, register_rule

MIN_DIM = 2048


class FP8LinearRule(Rule):
    name = "fp8_linear"
    anchors = (aten.linear.default,)
    opt_in = "fp8"
    after = ("linear_cross_entropy", "experts")   # the LM head's loss and grouped experts keep theirs

    def match(self, ctx: RewriteContext, n: fx.Node):
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        if not isinstance(w, fx.Node) or w.op != "placeholder" or len(shape(w)) != 2:
            return None
        if dtype(x) != torch.bfloat16 or dtype(w) != torch.bfloat16:
            return f"FP8 GEMMs take bf16 operands here, not {dtype(x)} x {dtype(w)}"
        if any(not isinstance(s, int) for s in shape(x)):
            return "symbolic sizes: the per-layer FP8 decision needs the row count"
        N, K = shape(w)
        M = size_hint(val(x).numel()) // max(K, 1)
        if K % 16 or N % 16:
            return f"K x N = {K} x {N}: FP8 GEMMs need multiples of 16"
        if min(M, K, N) < MIN_DIM:
            return (f"{M} x {K} -> {N}: below {MIN_DIM} in some dim, where FP8 GEMMs gained <= 1.2x on the "
                    "H200 and the casts cost more; stays bf16")
        if val(x).device.type == "cuda" and torch.cuda.get_device_capability(val(x).device) < (8, 9):
            return "this GPU has no FP8 tensor cores (needs sm_89 or newer)"
        return x, w, b, (M, K, N)

    def emit(self, ctx: RewriteContext, n: fx.Node, plan) -> None:
        x, w, b, (M, K, N) = plan
        before = [node_line(n)]
        with ctx.graph.inserting_before(n):
            y = ctx.call(fp8_linear, (x, w, b), n)
        n.replace_all_uses_with(y)
        ctx.erase_dead([n])
        ctx.replaced(self.name, n, [n], f"FP8 linear ({M} x {K} -> {N}, e4m3 fwd, e5m2 grads, tensorwise)",
                     before, M=M, K=K, N=N, weight=parameter_name(w))


def parameter_name(w: fx.Node):
    """The module's name for the parameter placeholder ``w`` (``"layers.0.mlp.up_proj.weight"``), read
    from dynamo's source of it (``capture._keep_input_metadata``); None when unknown."""
    source = (w.meta.get("dynamo_input") or (None,))[0]
    parts = re.findall(r"\._(?:modules|parameters)\['([^']+)'\]", getattr(source, "name", "") or "")
    return ".".join(parts) or None


PATTERN = register_rule(FP8LinearRule())
