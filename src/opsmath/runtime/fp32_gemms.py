"""fp32 GEMMs that read a bf16 value, on bf16 tensor cores at fp32's accuracy.

Under ``torch.autocast`` some GEMMs still run in fp32 on CUDA cores (cuBLAS's SIMT ``sgemm``), though one of
their operands holds only bf16 values. The case that costs most: SDPA's math path (an attention whose mask
needs its gradient, T5's learned position bias) upcasts bf16 ``q``, ``k``, ``v`` to fp32 and computes
``q k^T``, ``p v`` and their gradients as fp32 ``bmm``s (T5 at width 2 on an H100: 3.07 ms of a 40.8 ms step,
BENCHMARKS.md). This joint-graph pass rewrites such a GEMM ``a @ b``, both fp32 on CUDA, where ``a`` (or ``b``)
is ``convert_element_type(x, float32)`` of a bf16 ``x`` behind views:

- both operands upcasts of bf16: ``bmm.dtype(x, y, float32)``: the same products (a bf16 product is exact in
  fp32), summed in fp32 by the tensor cores;
- the other operand ``f`` a true fp32 value: ``f = f_hi + f_mid + f_lo``, three bf16 terms (``f_hi =
  bf16(f)``, ``f_mid = bf16(f - f_hi)``, ``f_lo = bf16(f - f_hi - f_mid)``: 24 significant bits, fp32's own,
  for normal values), and ``x @ f = x @ f_lo + x @ f_mid + x @ f_hi``, three bf16 GEMMs writing fp32, summed
  smallest first.

Numerics: every product is the fp32 GEMM's own; only the summation order differs (tensor-core fp32
accumulation), so the result is within cuBLAS fp32's error of fp64, not bit-identical to eager's. A GEMM of two
true fp32 values (a rotary embedding's ``inv_freq @ positions``, computed in fp32 on purpose) is left alone.

Scope: CUDA joint graphs, ``mm`` and ``bmm`` (``mm.dtype`` / ``bmm.dtype`` have no CPU kernel), where this
torch's Inductor lowers them with an ``out_dtype``. Opt-in (``OPSMATH_FP32_GEMMS=1``) until measured on a GPU.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Optional

import torch
import torch.fx as fx

from opsmath.memory.weight_casts import CAST_OPS, is_view

aten, prims = torch.ops.aten, torch.ops.prims
_WIDE = {aten.mm.default: aten.mm.dtype, aten.bmm.default: aten.bmm.dtype}
REWRITTEN = [0]   # GEMMs rewritten in this process


def enabled() -> bool:
    """``OPSMATH_FP32_GEMMS=1``, where this torch's Inductor lowers ``mm`` and ``bmm`` with an ``out_dtype``."""
    return os.environ.get("OPSMATH_FP32_GEMMS", "0") == "1" and _lowered()


@functools.lru_cache(maxsize=1)
def _lowered() -> bool:
    try:
        from torch._inductor.kernel.bmm import tuned_bmm
        from torch._inductor.kernel.mm import tuned_mm
        return all("out_dtype" in inspect.signature(f).parameters for f in (tuned_mm, tuned_bmm))
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


def joint_pass():
    """The joint-graph pass, or None where it is off."""
    if not enabled():
        return None

    def rewrite(graph: fx.Graph) -> None:
        REWRITTEN[0] += fp32_gemms(graph)
    rewrite.cache_key = "fp32-gemms-bf16x3"
    return rewrite


def fp32_gemms(graph: fx.Graph) -> int:
    """Rewrite each fp32 CUDA ``mm``/``bmm`` of ``graph`` with an operand that is an upcast bf16 value (module
    doc); returns how many."""
    done = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _WIDE]:
        a, b = node.args[:2]
        if not all(_fp32_cuda(v) for v in (a, b, node)):
            continue
        if _upcast(a) is None and _upcast(b) is None:
            continue
        with graph.inserting_before(node):   # the casts left unread go with the partition's dead code
            xa, xb = _bf16_source(graph, a), _bf16_source(graph, b)
            out = _products(graph, node, xa, xb, a, b)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        done += 1
    if done:
        graph.lint()
    return done


def _fp32_cuda(n) -> bool:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.is_cuda and v.dtype == torch.float32


def _upcast(n: fx.Node) -> Optional[tuple[fx.Node, list[fx.Node]]]:
    """``(x, views)`` where ``n`` is ``views(cast(x, float32))`` of a bf16 ``x`` (views outermost first)."""
    chain = []
    while is_view(n) and isinstance(n.args[0], fx.Node):
        chain.append(n)
        n = n.args[0]
    if not (n.op == "call_function" and n.target in CAST_OPS and isinstance(n.args[0], fx.Node)):
        return None
    x = n.args[0]
    v = x.meta.get("val")
    return (x, chain) if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else None


def _bf16_source(graph: fx.Graph, n: fx.Node) -> Optional[fx.Node]:
    """``n``'s views replayed on its bf16 source (``_upcast``), at the graph's insert point; None if none."""
    found = _upcast(n)
    if found is None:
        return None
    x, chain = found
    for view in reversed(chain):
        x = _call(graph, view, view.target, (x, *view.args[1:]), dict(view.kwargs))
    return x


def _products(graph: fx.Graph, like: fx.Node, xa, xb, a, b) -> fx.Node:
    """``a @ b`` as bf16 GEMMs writing fp32: one where both are bf16 (``xa``, ``xb``), else three over the
    split of the fp32 one, smallest terms first."""
    wide = _WIDE[like.target]
    if xa is not None and xb is not None:
        return _call(graph, like, wide, (xa, xb, torch.float32), {})
    terms = _split3(graph, like, b if xb is None else a)
    outs = [_call(graph, like, wide, (xa, t, torch.float32) if xb is None else (t, xb, torch.float32), {})
            for t in reversed(terms)]
    total = outs[0]
    for o in outs[1:]:
        total = _call(graph, like, aten.add.Tensor, (total, o), {})
    return total


def _split3(graph: fx.Graph, like: fx.Node, f: fx.Node) -> list[fx.Node]:
    """``[hi, mid, lo]``, bf16 terms whose fp32 sum is ``f`` (its 24 significant bits, 8 in each)."""
    terms, rest = [], f
    for i in range(3):
        t = _call(graph, like, prims.convert_element_type.default, (rest, torch.bfloat16), {})
        terms.append(t)
        if i < 2:
            up = _call(graph, like, prims.convert_element_type.default, (t, torch.float32), {})
            rest = _call(graph, like, aten.sub.Tensor, (rest, up), {})
    return terms


def _call(graph: fx.Graph, like: fx.Node, target, args: tuple, kwargs: dict) -> fx.Node:
    """A node calling ``target`` with ``like``'s meta (stack trace, sequence number) and its own fake value."""
    node = graph.call_function(target, args, kwargs)
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")})
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    node.meta["val"] = target(*vals, **kwargs)
    return node
