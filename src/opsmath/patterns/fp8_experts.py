"""FP8 experts (``optimize(model, fp8=True)``): the grouped GEMMs of mixture-of-experts layers to
``kernels.fp8_grouped_mm``, rowwise-scaled FP8 GEMMs for the output and the input gradient.

Anchors: a grouped GEMM over rows sorted by expert, ``y = grouped_mm(x [S, K], w [G, K, N], offs)``, as
the experts rewrite emits it (``torch._grouped_mm``, ``opsmath::grouped_mm``) and as Hugging Face's
default grouped experts call it (``torch._grouped_mm``, or its fallback op, swapped for
``opsmath::grouped_mm`` by the experts family). It applies to GEMMs computing in bf16, and to fp32 ones in
a graph under bf16 autocast: Hugging Face's fallback runs the experts of fp32 master weights in fp32
because autocast does not reach a custom op, where a user asking for FP8 expects autocast's bf16 at least,
and gets FP8 where it pays, else bf16. K and N multiples of 16; FP8 on sm_90 or newer
(``torch._scaled_grouped_mm``).

Priced by measurement per shape (``benchmarks/grouped_gemm.py``, H200, torch 2.11, forward and backward
under Inductor, static shapes; ``benchmarks/results/grouped-gemm-fp8-static-h200-20261204.json``): FP8 with
its casts against a bf16 grouped GEMM, by kernel time, ran 1.39x at 8 experts of 4096 -> 14336 (2048 rows
each), 1.02-1.06x at 2048 -> 5632 and 4096 -> 4096, 0.89-0.93x at 1024 -> 5632 and 2048 -> 2048, and 0.69-0.97x
with 32 to 128 experts (256-1024 rows each). The casts (x, dy and the weights per call) and the bf16 weight
gradient cost what the FP8 products save unless the GEMMs are large: ``fp8_pays`` asks for
``K N / (K + N) >= MIN_HARMONIC`` and ``MIN_ROWS_PER_EXPERT`` rows per expert on average. Where it does not
pay, a bf16 grouped GEMM stays bf16 (declined with that reason), and an fp32 one under autocast, whose
alternative is fp32 GEMMs, runs as a bf16 grouped GEMM, autocast's dtype (faster than FP8 there and closer
to eager). Outputs keep eager's dtypes; the FP8 weight gradient is bf16 (see the kernel's docstring).
Opt-in with the FP8 linears: FP8 and bf16 change numerics beyond the tolerance rule.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from opsmath.kernels.fp8_grouped_mm import fp8_grouped_mm
from opsmath.kernels.grouped_mm import grouped_op
from opsmath.rewrite.canonicalize import aten, dtype, shape, size_hint, under_bf16_autocast
from opsmath.rewrite.match import RewriteContext, node_line
from opsmath.rewrite.rules import Rule, register_rule

MIN_HARMONIC = 3000          # K N / (K + N): 4096 -> 14336 is 3186, 4096 -> 4096 is 2048 (module docstring)
MIN_ROWS_PER_EXPERT = 2048   # S / G: 8 experts over 16384 rows
RECOMPUTE_ID = 1 << 20       # ac_graph_id of the recomputed weight casts, apart from the memory plan's segments


def fp8_pays(S: int, G: int, K: int, N: int) -> bool:
    """Whether FP8 grouped GEMMs with their casts beat bf16's at ``S`` rows over ``G`` experts, K -> N
    (measured on the H200: module docstring). The casts scale with S (K + N) and the products with S K N,
    hence the harmonic size; fewer rows per expert make FP8's grouped kernel the slower one."""
    return S >= MIN_ROWS_PER_EXPERT * G and K * N >= MIN_HARMONIC * (K + N)


def _operands(ctx: RewriteContext, n: fx.Node):
    """``(x, w, offs, (S, G, K, N), kind)`` of a 2-D x 3-D grouped GEMM this family takes, ``kind`` "fp8", or
    "bf16" for an fp32 one under autocast where FP8 does not pay; else why not."""
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
    device = getattr(n.meta.get("val"), "device", None)
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        why = "FP8 grouped GEMMs (torch._scaled_grouped_mm) need sm_90 or newer"
    elif not fp8_pays(S, G, K, N):
        why = (f"{G} experts, {S} rows, {K} -> {N}: FP8 with its casts pays from K N / (K + N) >= {MIN_HARMONIC} "
               f"and {MIN_ROWS_PER_EXPERT} rows per expert (measured 0.69-1.06x below, benchmarks/grouped_gemm.py, H200)")
    else:
        return x, w, offs, (S, G, K, N), "fp8"
    return f"a bf16 grouped GEMM: {why}; stays bf16" if kinds == {torch.bfloat16} else (x, w, offs, (S, G, K, N), "bf16")


def _bf16(ctx: RewriteContext, n: fx.Node, x, w, offs, K: int, N: int) -> fx.Node:
    """``grouped_mm(x, w, offs)`` of fp32 operands in bf16, as autocast computes a matmul; the weight's bf16
    cast tagged for recompute, so that Inductor's partitioner keeps the fp32 parameter (resident anyway)
    for backward rather than a bf16 copy of every expert weight (op by op, autograd keeps the copy)."""
    w16 = ctx.cast(w, torch.bfloat16, n)
    w16.meta.update(recompute=CheckpointPolicy.MUST_RECOMPUTE, ac_graph_id=RECOMPUTE_ID)
    y = ctx.call(grouped_op(torch.bfloat16, torch.bfloat16, K, N), (ctx.cast(x, torch.bfloat16, n), w16, offs), n)
    return ctx.cast(y, dtype(x), n)


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
        x, w, offs, (S, G, K, N), kind = plan
        before = [node_line(n)]
        with ctx.graph.inserting_before(n):
            y = ctx.call(fp8_grouped_mm, (x, w, offs), n) if kind == "fp8" else _bf16(ctx, n, x, w, offs, K, N)
        n.replace_all_uses_with(y)
        ctx.erase_dead([n])
        what = (f"FP8 grouped GEMM ({G} experts, {S} rows, {K} -> {N}; e4m3 rowwise, weight gradient bf16)"
                if kind == "fp8" else f"bf16 grouped GEMM, autocast's dtype ({G} experts, {S} rows, {K} -> {N}: "
                f"too small for FP8 to pay, fp8_pays)")
        ctx.replaced(self.name, y, [n], what, before, S=S, G=G, K=K, N=N, dtype=kind)


PATTERN = register_rule(FP8ExpertsRule())
