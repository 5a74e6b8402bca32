"""A model library's own grouped GEMM fallback, swapped for ``opsmath::grouped_mm``; its gathered rows read
through the routing index where that is faster.

Hugging Face's grouped experts (``experts_implementation="grouped_mm"``, Mixtral's and Qwen2-MoE's
default) call ``torch._grouped_mm`` in bf16, but under dynamo with weights of any other dtype (fp32 master
weights under autocast, the usual mixed-precision recipe) they call their custom op
``transformers::grouped_mm_fallback``: one ``mm`` per expert, in the weights' dtype. Its backward reads
the group offsets on the host while AOTAutograd traces it (``offs.tolist()``), which no compiler can
trace: ``torch.compile`` breaks the graph there, and a whole captured graph would fail in Inductor.

``opsmath::grouped_mm`` (``src/opsmath/kernels/grouped_mm.py``) computes the same function in the operands'
dtype, forward and backward, with its backward opaque too: the graph stays whole and compiles. On CUDA it
runs as one Triton grouped GEMM without host syncs; fp32 operands there (sm_80 and newer) take three TF32
products per tile (on sm_90 with the token rows split once ahead), within the tolerance rule of cuBLAS's fp32
``mm`` (the kernel's docstring), where the fallback runs SIMT fp32.

The library's first grouped GEMM reads ``hidden[perm // k]``, the token rows sorted by expert, a copy k times
the tokens that backward keeps. Where ``grouped_gather.gather_wins`` says so (opt-in, ``OPSMATH_GATHER_GEMM``),
the gather and the GEMM become ``opsmath::grouped_mm_gather``, which reads the rows through the index
(``gather_rows``).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from opsmath.kernels.grouped_gather import gather_wins
from opsmath.kernels.grouped_mm import linear_layout
from opsmath.rewrite.canonicalize import aten, dtype, shape, under_bf16_autocast, val
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
        why = ("; fp32 under bf16 autocast, as eager runs it (on sm_80+ GPUs as three TF32 products, within the "
               "tolerance rule): autocast does not reach the library's grouped GEMM "
               "(fp8=True runs it in bf16, or in FP8 where that pays: docs/rewrites.md#fp8_experts-opt-in-with-fp8_linear)")
    ctx.replaced(pattern, new, [node], f"opsmath::grouped_mm (the library's per-expert fallback, "
                 f"{str(dtype(x)).replace('torch.', '')}, with a compilable backward{why})", before)


_GROUPED = (aten._grouped_mm.default, torch.ops.opsmath.grouped_mm.default)
_CASTS = (aten._to_copy.default, aten.to.dtype)


def gather_rows(ctx: RewriteContext, pattern: str) -> None:
    """Each grouped GEMM ``grouped(src[rows], w, offs)`` (the gathered rows, possibly cast, read by it alone)
    to ``opsmath::grouped_mm_gather(src, rows, w, offs)`` where ``gather_wins`` says so."""
    for node in [n for n in ctx.graph.nodes if n.op == "call_function" and n.target in _GROUPED]:
        plan = _gather_plan(node)
        if plan is not None:
            ctx.offer(pattern, node, plan, lambda node=node, plan=plan: _gather(ctx, pattern, node, plan))


def _gather_plan(node: fx.Node):
    """``(src, rows, index, cast)`` (the gather node and the cast between, or None) when ``node``'s rows are a
    gather it alone reads and the gathered op wins."""
    args = list(node.args) + ([node.kwargs["offs"]] if "offs" in node.kwargs else [])
    if len(args) != 3 or set(node.kwargs) - {"offs"} or not isinstance(args[0], fx.Node):
        return None
    x, w = args[0], args[1]
    cast = x if x.op == "call_function" and x.target in _CASTS and len(x.users) == 1 else None
    index = cast.args[0] if cast is not None else x
    if not (isinstance(index, fx.Node) and index.target is aten.index.Tensor and len(index.users) == 1):
        return None
    src, rows = index.args[0], index.args[1]
    if len(rows) != 1 or not isinstance(rows[0], fx.Node) or len(shape(src)) != 2 or len(shape(w)) != 3 \
            or dtype(x) != dtype(w):
        return None
    S, T, (G, K, N) = shape(x)[0], shape(src)[0], shape(w)
    if not all(isinstance(d, int) for d in (S, T, G, K, N)) or not _in_range(rows[0], T):
        return None
    if not gather_wins(S, T, K, N, G, dtype(w), val(w).device, linear_layout(val(w))):
        return None
    return src, rows[0], index, cast


def _in_range(rows: fx.Node, T: int) -> bool:
    """Whether ``rows`` is provably a valid row index of T rows: a sort's permutation of T k slots, floor-
    divided by k (``perm // k``, HF's), or of T slots. (The kernel reads rows unchecked, where ``x[rows]``
    would raise on an index out of range or wrap a negative one.)"""
    k = 1
    if rows.op == "call_function" and rows.target in (aten.div.Tensor_mode, aten.floor_divide.default) \
            and (rows.target is aten.floor_divide.default or rows.kwargs.get("rounding_mode") == "floor") \
            and isinstance(rows.args[1], int) and rows.args[1] > 0 and isinstance(rows.args[0], fx.Node):
        rows, k = rows.args[0], rows.args[1]
    if not (rows.op == "call_function" and rows.target is operator.getitem and rows.args[1] == 1):
        return False
    sort = rows.args[0]
    return sort.op == "call_function" and sort.target in (aten.sort.default, aten.sort.stable) \
        and len(shape(sort.args[0])) == 1 and shape(sort.args[0])[0] == T * k


def _gather(ctx: RewriteContext, pattern: str, node: fx.Node, plan) -> None:
    src, rows, index, cast = plan
    w = node.args[1]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs["offs"]
    before = [node_line(node)]
    with ctx.graph.inserting_before(node):
        x = ctx.cast(src, dtype(w), node) if dtype(src) != dtype(w) else src
        new = ctx.call(torch.ops.opsmath.grouped_mm_gather.default, (x, rows, w, offs), node)
    node.replace_all_uses_with(new)
    replaced = [node] + [n for n in (cast, index) if n is not None]
    ctx.erase_dead([node])   # and its input's cast and gather, which only it read
    ctx.replaced(pattern, new, replaced, "opsmath::grouped_mm_gather (the grouped GEMM reads its sorted rows through "
                 "the routing index: no sorted copy of the tokens)", before)
