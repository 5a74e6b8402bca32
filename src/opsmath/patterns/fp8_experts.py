"""FP8 experts (``optimize(model, fp8=True)``): the grouped GEMMs of mixture-of-experts layers to
``kernels.fp8_grouped_mm``, rowwise-scaled FP8 GEMMs for the output and the input gradient.

Anchors: a grouped GEMM over rows sorted by expert, ``y = grouped_mm(x [S, K], w [G, K, N], offs)``, as
the experts rewrite emits it (``torch._grouped_mm``, ``opsmath::grouped_mm``) and as Hugging Face's
default grouped experts call it (``torch._grouped_mm``, or its fallback op, swapped for
``opsmath::grouped_mm`` by the experts family). It applies to GEMMs computing in bf16, and to fp32 ones in
a graph under bf16 autocast: Hugging Face's fallback runs the experts of fp32 master weights in fp32
because autocast does not reach a custom op, where a user asking for FP8 expects autocast's bf16 and gets
FP8. K and N multiples of 16, on sm_90 or newer (``torch._scaled_grouped_mm``).

Priced by measurement (``benchmarks/grouped_gemm.py``, H200, torch 2.11, forward and backward under
Inductor): against a bf16 grouped GEMM, FP8 with its casts ran 0.70-0.75x as fast at 8 experts (K, N from
1024 to 14336) and 0.40x at 64, although the FP8 products alone ran 1.3x bf16's: the casts, the weight's
transposed copy and the bf16 weight gradient cost more than they save. So a bf16 grouped GEMM stays bf16,
with that reason in the report (``BF16_PAYS``); an fp32 one under autocast, whose alternative is fp32
GEMMs, runs FP8 (HF Mixtral-style, 8 layers, B4 T2048: 43.1 ms against 200.3 ms for ``torch.compile``,
measured with the kernel's first form, which quantized the weights again for the input gradient).
Outputs keep eager's dtypes; the weight gradient is bf16 (see the kernel's docstring). Opt-in with the
FP8 linears: FP8 changes numerics beyond the tolerance rule.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from opsmath.kernels.fp8_grouped_mm import fp8_grouped_mm
from opsmath.rewrite.canonicalize import aten, dtype, shape, size_hint, under_bf16_autocast
from opsmath.rewrite.match import RewriteContext, node_line
from opsmath.rewrite.rules import Rule, register_rule

BF16_PAYS = False    # FP8 for bf16 grouped GEMMs: measured slower on the H200 (module docstring)


def _operands(ctx: RewriteContext, n: fx.Node):
    """``(x, w, offs, (S, G, K, N))`` of a 2-D x 3-D grouped GEMM that FP8 takes; else why not."""
    args, kwargs = list(n.args), dict(n.kwargs)
    offs = args[2] if len(args) > 2 else kwargs.pop("offs", None)
    x, w = args[0], args[1]
    if offs is None or len(args) > 3 or any(v is not None for v in kwargs.values()):
        return "a grouped GEMM with a bias, an output dtype or no offsets"
    if len(shape(x)) != 2 or len(shape(w)) != 3:
        return f"a {len(shape(x))}-D x {len(shape(w))}-D grouped GEMM (FP8 takes rows x stacked weights)"
    kinds = {dtype(x), dtype(w)}
    if kinds != {torch.bfloat16} and not (kinds == {torch.float32} and under_bf16_autocast(ctx.graph, n)):
        return f"computes in {', '.join(sorted(str(k).replace('torch.', '') for k in kinds))} (FP8 takes bf16 " \
               "GEMMs, or fp32 ones under bf16 autocast)"
    S, (G, K, N) = size_hint(shape(x)[0]), [size_hint(d) for d in shape(w)]
    if K % 16 or N % 16:
        return f"K x N = {K} x {N}: FP8 GEMMs need multiples of 16"
    if kinds == {torch.bfloat16} and not BF16_PAYS:
        return ("a bf16 grouped GEMM: FP8 grouped GEMMs with their casts measured 0.40-0.75x its speed on the "
                "H200 (benchmarks/grouped_gemm.py); stays bf16")
    device = getattr(n.meta.get("val"), "device", None)
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return "FP8 grouped GEMMs (torch._scaled_grouped_mm) need sm_90 or newer"
    return x, w, offs, (S, G, K, N)


class FP8ExpertsRule(Rule):
    name = "fp8_experts"
    anchors = (aten._grouped_mm.default, torch.ops.opsmath.grouped_mm.default)
    opt_in = "fp8"
    after = ("experts",)          # the grouped GEMMs of rewritten loops and swapped library fallbacks
    dynamic_shapes = True
    data_dependent_shapes = True

    def match(self, ctx: RewriteContext, n: fx.Node):
        return _operands(ctx, n)

    def emit(self, ctx: RewriteContext, n: fx.Node, plan) -> None:
        x, w, offs, (S, G, K, N) = plan
        before = [node_line(n)]
        with ctx.graph.inserting_before(n):
            y = ctx.call(fp8_grouped_mm, (x, w, offs), n)
        n.replace_all_uses_with(y)
        ctx.erase_dead([n])
        ctx.replaced(self.name, y, [n], f"FP8 grouped GEMM ({G} experts, {S} rows, {K} -> {N}; e4m3 rowwise, "
                     "weight gradient bf16)", before, S=S, G=G, K=K, N=N)


PATTERN = register_rule(FP8ExpertsRule())
