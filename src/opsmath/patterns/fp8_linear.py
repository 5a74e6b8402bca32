"""FP8 linear layers (``optimize(model, fp8=True)``): ``linear(x, W[, b])`` to ``kernels.fp8_linear``,
FP8 GEMMs forward and backward with tensorwise dynamic scaling, where FP8 pays.

Anchor: ``aten.linear.default`` whose weight is a graph input (a parameter), computing in bf16, K and N
multiples of 16: bf16 operands, or fp32 ones under bf16 autocast (fp32 master weights, the usual mixed
precision). Then x, W and b are cast to bf16 explicitly before the FP8 op, as autocast would (a custom
Function sees its inputs uncast), and W's gradient flows back through the cast to the fp32 parameter;
under Inductor the bf16 cast fuses into the weight's FP8 cast. Per layer, by measured shape (docs/anchors ``fp8_gemm``, H200): FP8 GEMMs are 1.38-1.84x
bf16 from K, N >= 2048 at 8192 rows, 1.19x at 768 -> 3072, and the casts cost a share that shrinks with
size; a GEMM with K, N or the row count below ``MIN_DIM`` stays bf16, and the report says so per layer.
Except a layer whose input another FP8 layer also reads (k and v beside q, gate beside up): the input's
amax and cast are then computed once for all of them (AOTAutograd's CSE under Inductor), so such a
layer pays only its weight's and gradient's casts, and runs FP8 from ``SHARED_MIN_DIM``.
With ``fp8="cached"``, a weight that requires grad is not cast in the graph: its e4m3 copy and scale become
two more graph inputs, made once per optimizer step (``opsmath.runtime.fp8_weights``; ``skip=["fp8_weight_cache"]``
keeps chosen layers casting in the graph). Default tensorwise casts in the graph: under Inductor the
partition saves the bf16 weight and casts again in backward, holding no copy. Opt-in: applied only when
``optimize(..., fp8=True)`` (FP8 changes numerics beyond the tolerance rule).
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import aten, dtype, shape, size_hint, val
from opsmath.meta_keys import FP8_WEIGHT as META
from opsmath.kernels.fp8_linear import E4M3, fp8_linear
from opsmath.rewrite.match import RewriteContext, node_line
from opsmath.rewrite.rules import Rule, register_rule

MIN_DIM = 2048
WEIGHT_CACHE = "fp8_weight_cache"   # ``skip=`` name: cast weights in every forward (opsmath.runtime.fp8_weights)
SHARED_MIN_DIM = 1024


class FP8LinearRule(Rule):
    name = "fp8_linear"
    anchors = (aten.linear.default,)
    opt_in = "fp8"
    scaling = "tensorwise"   # or "rowwise": ``with_scaling``
    weight_cache = False     # tensorwise weights cast once per optimizer step (``fp8="cached"``)
    after = ("linear_cross_entropy", "experts")   # the LM head's loss and grouped experts keep theirs

    def match(self, ctx: RewriteContext, n: fx.Node):
        found = _operands(n)
        if not isinstance(found, tuple):
            return found
        x, _, _, (M, K, N) = found
        if min(M, K, N) < MIN_DIM and not (min(M, K, N) >= SHARED_MIN_DIM and _sibling(n, x)):
            return (f"{M} x {K} -> {N}: below {MIN_DIM} in some dim (below {SHARED_MIN_DIM} where another "
                    "FP8 layer reads the same input), where FP8 GEMMs gained <= 1.2x on the H200 and the casts "
                    "cost more; stays bf16")
        if val(x).device.type == "cuda" and torch.cuda.get_device_capability(val(x).device) < (8, 9):
            return "this GPU has no FP8 tensor cores (needs sm_89 or newer)"
        return found

    def emit(self, ctx: RewriteContext, n: fx.Node, plan) -> None:
        x, w, b, (M, K, N) = plan
        before = [node_line(n)]
        copy = _weight_copy(ctx, w, n) if self.weight_cache and self.scaling == "tensorwise" else None
        with ctx.graph.inserting_before(n):
            x16, w16, b16 = [ctx.cast(t, torch.bfloat16, n) for t in (x, w if copy is None else None, b)]
            args = (x16, w, b16, False, *copy) if copy else (x16, w16, b16, self.scaling == "rowwise")
            y = ctx.call(fp8_linear, args, n)
        n.replace_all_uses_with(y)
        ctx.erase_dead([n])
        how = "e4m3, rowwise" if self.scaling == "rowwise" else "e4m3 fwd, e5m2 grads, tensorwise" \
            + (", weight cast once per optimizer step" if copy else "")
        ctx.replaced(self.name, n, [n], f"FP8 linear ({M} x {K} -> {N}, {how})", before, M=M, K=K, N=N,
                     weight=parameter_name(w), weight_cast="once per optimizer step" if copy else "every forward")


def _weight_copy(ctx: RewriteContext, w: fx.Node, n: fx.Node):
    """The graph inputs ``(q, s)`` taking ``w``'s e4m3 copy and scale made ahead (``opsmath.runtime.fp8_weights``),
    added once per weight; None where the copy is not kept: the weight needs no gradient (a frozen
    weight has no optimizer step to tie the copy to), is not a plain tensor, or the user skipped it."""
    placeholders = list(ctx.graph.find_nodes(op="placeholder"))
    real = ctx.inputs[placeholders.index(w)] if ctx.inputs is not None else None
    if type(real) not in (torch.Tensor, torch.nn.Parameter) or not (real.requires_grad and real.is_leaf) \
            or not ctx.allowed(WEIGHT_CACHE, n) or ctx.fake_mode is None:
        return None
    made = {p.meta[META]: p for p in placeholders if META in p.meta}
    if (w.name, "q") not in made:
        with ctx.fake_mode:
            q, s = torch.empty(val(w).shape, dtype=E4M3, device=val(w).device), torch.ones((), device=val(w).device)
        made = {(w.name, k): ctx.add_input(f"{w.name}_fp8_{k}", fake, w, **{META: (w.name, k)})
                for k, fake in (("q", q), ("s", s))}
    return made[(w.name, "q")], made[(w.name, "s")]


def with_scaling(rule: FP8LinearRule, scaling: str, weight_cache: bool = False) -> FP8LinearRule:
    """A copy of ``rule`` emitting ``scaling`` ("tensorwise" or "rowwise") FP8 GEMMs; ``weight_cache``: a
    tensorwise weight's copy made once per optimizer step (``opsmath.runtime.fp8_weights``)."""
    import copy
    out = copy.copy(rule)
    out.scaling, out.weight_cache = scaling, weight_cache
    return out


def _operands(n: fx.Node):
    """``(x, W, b, (M, K, N))`` of a ``linear`` of a 2-D parameter that FP8 GEMMs can take; else why not
    (a string), or None when ``W`` is not a parameter."""
    x, w = n.args[0], n.args[1]
    b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    if not isinstance(w, fx.Node) or w.op != "placeholder" or len(shape(w)) != 2:
        return None
    if dtype(n) != torch.bfloat16 or {dtype(x), dtype(w)} - {torch.bfloat16, torch.float32}:
        return (f"FP8 GEMMs take bf16 operands here (or fp32 under bf16 autocast), not {dtype(x)} x {dtype(w)} "
                f"computing in {dtype(n)}")
    if any(not isinstance(s, int) for s in shape(x)):
        return "symbolic sizes: the per-layer FP8 decision needs the row count"
    N, K = shape(w)
    if K % 16 or N % 16:
        return f"K x N = {K} x {N}: FP8 GEMMs need multiples of 16"
    return x, w, b, (size_hint(val(x).numel()) // max(K, 1), K, N)


def _sibling(n: fx.Node, x) -> bool:
    """Whether another layer reading ``x`` runs FP8 (already rewritten, or on its own sizes): its cast
    of ``x`` is then shared."""
    def fp8(u):
        if u.op != "call_function" or u is n:
            return False
        if u.target is fp8_linear:
            return True
        found = _operands(u) if u.target is aten.linear.default else None
        return isinstance(found, tuple) and min(found[3]) >= MIN_DIM
    return isinstance(x, fx.Node) and any(fp8(u) for u in x.users)


def parameter_name(w: fx.Node):
    """The module's name for the parameter placeholder ``w`` (``"layers.0.mlp.up_proj.weight"``), read
    from dynamo's source of it (``capture._keep_input_metadata``); None when unknown."""
    source = (w.meta.get("dynamo_input") or (None,))[0]
    parts = re.findall(r"\._(?:modules|parameters)\['([^']+)'\]", getattr(source, "name", "") or "")
    return ".".join(parts) or None


PATTERN = register_rule(FP8LinearRule())
