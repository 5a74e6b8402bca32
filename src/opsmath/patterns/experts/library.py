"""A model library's own grouped GEMM fallback, swapped for ``opsmath::grouped_mm``.

Hugging Face's grouped experts (``experts_implementation="grouped_mm"``, Mixtral's and Qwen2-MoE's
default) call ``torch._grouped_mm`` in bf16, but under dynamo with weights of any other dtype (fp32 master
weights under autocast, the usual mixed-precision recipe) they call their custom op
``transformers::grouped_mm_fallback``: one ``mm`` per expert, in the weights' dtype. Its backward reads
the group offsets on the host while AOTAutograd traces it (``offs.tolist()``), which no compiler can
trace: ``torch.compile`` breaks the graph there, and a whole captured graph would fail in Inductor.

``opsmath::grouped_mm`` (``src/opsmath/kernels/grouped_mm.py``) computes the same function the same way, ``mm`` per
group in the operands' dtype, forward and backward, with its backward opaque too: the graph stays whole
and compiles. Same dtypes, same per-group GEMMs: the values are eager's.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import dtype, under_bf16_autocast
from opsmath.rewrite.match import RewriteContext, node_line


def library_fallbacks() -> set:
    """The library grouped GEMM ops registered in this process (none without transformers)."""
    ns = getattr(torch.ops, "transformers", None)
    op = getattr(ns, "grouped_mm_fallback", None) if ns is not None else None
    return {op.default} if op is not None else set()


def swap_library_fallbacks(ctx: RewriteContext, pattern: str) -> None:
    """Replace each ``transformers::grouped_mm_fallback(x, w, offs)`` by ``opsmath::grouped_mm``."""
    targets = library_fallbacks()
    for node in [n for n in ctx.graph.nodes if n.op == "call_function" and n.target in targets]:
        ctx.offer(pattern, node, _plan(node), lambda node=node: _emit(ctx, pattern, node))


def _plan(node: fx.Node):
    x, w = node.args[0], node.args[1]
    if len(node.args) != 3 or node.kwargs and set(node.kwargs) != {"offs"}:
        return f"{node.target} called with arguments {list(node.kwargs)} not understood"
    if dtype(x) != dtype(w):
        return f"operands in different dtypes ({dtype(x)}, {dtype(w)})"
    return True


def _emit(ctx: RewriteContext, pattern: str, node: fx.Node) -> None:
    x, w = node.args[0], node.args[1]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs["offs"]
    before = [node_line(node)]
    with ctx.graph.inserting_before(node):
        new = ctx.call(torch.ops.opsmath.grouped_mm.default, (x, w, offs), node)
    node.replace_all_uses_with(new)
    ctx.graph.erase_node(node)
    why = ""
    if dtype(x) == torch.float32 and under_bf16_autocast(ctx.graph, node):   # measured: a 5x slower step than bf16 weights
        why = ("; fp32 under bf16 autocast, as eager runs it: autocast does not reach the library's grouped GEMM "
               "(fp8=True runs it in bf16, or in FP8 where that pays: docs/rewrites.md#fp8_experts-opt-in-with-fp8_linear)")
    ctx.replaced(pattern, new, [node], f"opsmath::grouped_mm (the library's per-expert fallback, "
                 f"{str(dtype(x)).replace('torch.', '')}, with a compilable backward{why})", before)
