"""fp32 weight gradients written by their GEMM: the bf16 round trip of every autocast weight gradient removed.

Under ``torch.autocast`` with fp32 weights (HF Trainer ``bf16=True``, Lightning ``bf16-mixed``) a linear
layer's weight gradient is a bf16 GEMM, ``dW = dY^T X`` (``(N, M) @ (M, K) -> (N, K)``), which autograd
casts to the weight's fp32::

    mm(dY^T, X) -> bf16 (N, K) -> [views] -> convert_element_type(float32) -> W.grad

The GEMM writes 2 bytes per weight, a cast kernel reads them and writes 4: 8 bytes of traffic and a
launch per weight per step where writing the fp32 gradient takes 4 (LLaMA-shaped 0.5B, B4 T1024 on an H100:
the casts' 0.97 ms a step go, the GEMMs take 0.26 ms more for their wider output).
``aten.mm.dtype(dY^T, X, float32)`` has cuBLAS write its fp32 accumulator directly (Inductor lowers it to
``at::mm_dtype_out``); the views follow as before, the cast goes.

Numerics: the gradient is the GEMM's fp32 accumulator unrounded, so it is closer to an fp32 reference than
eager's bf16-rounded one (the tolerance rule holds by construction), not bit-identical to eager. This is
what Megatron-LM's gradient-accumulation fusion does. ``OPSMATH_FP32_WGRAD=0`` keeps eager's rounding.

Scope: a joint-graph pass (Inductor's ``joint_custom_post_pass``) on CUDA (``mm.dtype`` has no CPU kernel),
for the gradients of parameters only (an activation's gradient keeps eager's values), where the GEMM's
result feeds nothing but the cast (through single-use views), in bf16 only (an fp16 gradient that
overflows must reach GradScaler as the inf eager's would). A weight used twice (tied embeddings) sums
two gradients first and is left as it is.
"""
from __future__ import annotations

import functools
import inspect
import os

import torch
import torch.fx as fx

from opsmath.memory.weight_casts import CAST_OPS, is_view

aten, prims = torch.ops.aten, torch.ops.prims
_MM, _MM_FP32 = aten.mm.default, aten.mm.dtype
_NARROW = (torch.bfloat16,)   # fp16 keeps eager's values: GradScaler's overflow check sees what eager's would
# in this process: graphs compiled with the pass, and GEMMs it rewrote (``ladder.finish`` reads a graph's by
# difference; a graph Inductor's cache serves runs no joint pass, so its GEMMs are not counted)
PASSES, REWRITTEN = [0], [0]


def enabled() -> bool:
    """On unless ``OPSMATH_FP32_WGRAD=0``, where this torch's Inductor lowers ``mm`` with an ``out_dtype``."""
    return os.environ.get("OPSMATH_FP32_WGRAD", "1") != "0" and _lowered()


@functools.lru_cache(maxsize=1)
def _lowered() -> bool:
    try:
        from torch._inductor.kernel.mm import tuned_mm
        return "out_dtype" in inspect.signature(tuned_mm).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


def joint_pass(params: frozenset[int]):
    """The joint-graph pass for a graph whose parameters are the primals at ``params``
    (``weight_casts.param_positions``), or None where it is off."""
    if not enabled():
        return None

    PASSES[0] += 1

    def rewrite(graph: fx.Graph) -> None:
        REWRITTEN[0] += fp32_weight_grads(graph, params)
    rewrite.cache_key = f"fp32-wgrad {sorted(params)}"   # what the pass does depends on nothing else
    return rewrite


def fp32_weight_grads(graph: fx.Graph, params: frozenset[int]) -> int:
    """Rewrite each parameter gradient of the joint ``graph`` that is a narrow GEMM cast to fp32 (module
    doc); returns how many. The joint graph returns the forward's outputs, then one gradient per primal
    (``primals_<i + 1>``, None where it has none)."""
    primals = [n for n in graph.find_nodes(op="placeholder") if n.name.startswith("primals_")]
    outs = list(graph.output_node().args[0])
    grads = outs[len(outs) - len(primals):] if primals else []
    done = sum(1 for i, g in enumerate(grads) if i in params and isinstance(g, fx.Node) and _rewrite(graph, g))
    if done:
        graph.lint()
    return done


def _plain_cast(cast: fx.Node) -> bool:
    """``cast`` changes the dtype of a float tensor to fp32 and nothing else (strides preserved)."""
    if cast.op != "call_function" or cast.target not in CAST_OPS or not isinstance(cast.args[0], fx.Node):
        return False
    out = cast.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        return False
    if cast.target is aten._to_copy.default:
        kw = cast.kwargs
        return set(kw) <= {"dtype", "layout", "device"} and kw.get("layout", torch.strided) == torch.strided \
            and kw.get("device", out.device) == out.device
    return True


def _rewrite(graph: fx.Graph, cast: fx.Node) -> bool:
    """``cast(views(mm(a, b)))`` -> ``views(mm.dtype(a, b, float32))`` where ``a``, ``b`` are bf16 CUDA
    tensors and the GEMM and each view have one user."""
    if not _plain_cast(cast):
        return False
    chain, src = [], cast.args[0]   # the views from the cast up to the GEMM
    while is_view(src) and len(src.users) == 1 and isinstance(src.args[0], fx.Node):
        chain.append(src)
        src = src.args[0]
    if src.op != "call_function" or src.target is not _MM or len(src.users) != 1:
        return False
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in src.args]
    if not all(isinstance(v, torch.Tensor) and v.is_cuda and v.dtype in _NARROW for v in vals):
        return False
    with graph.inserting_before(cast):
        node = _copy(graph, src, _MM_FP32, (*src.args, torch.float32), {})
        for view in reversed(chain):
            node = _copy(graph, view, view.target, (node, *view.args[1:]), dict(view.kwargs))
    cast.replace_all_uses_with(node)
    for old in (cast, *chain, src):
        graph.erase_node(old)
    return True


def _copy(graph: fx.Graph, like: fx.Node, target, args: tuple, kwargs: dict) -> fx.Node:
    """A node calling ``target`` with ``like``'s meta (stack trace, sequence number) and its own fake value."""
    node = graph.call_function(target, args, kwargs)
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")})
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    node.meta["val"] = target(*vals, **kwargs)
    return node


def report_note(graphs) -> list[str]:
    """The report's line: where a graph was compiled with the pass (``fp32_wgrad`` not None), and its counts."""
    on = [g.fp32_wgrad for g in graphs if getattr(g, "fp32_wgrad", None) is not None]
    if not on:
        return []
    none = sum(1 for n in on if not n)
    counted = f"{sum(on)} GEMMs rewritten" + (f" ({none} graphs count none: no such GEMM, or served from "
                                               "Inductor's cache)" if none else "")
    return [f"weight gradients of bf16 GEMMs written in fp32 by the GEMM, no bf16 rounding or cast kernel, in "
            f"{len(on)} graphs: {counted}; OPSMATH_FP32_WGRAD=0 rounds them as eager"]
