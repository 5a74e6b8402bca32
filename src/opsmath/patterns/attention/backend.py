"""The attention family's pass after matching: which kernel each ``opsmath::attention`` runs.

Matching and emitting are pure: the rule always emits ``opsmath::attention`` and marks the node with
its match (``meta[MATCH]``). Once every rule has run, ``choose_backends`` asks the tuner
(``kernels.attention.tuning.backend_for``, which measures the candidates on the GPU for these shapes and
caches the answer) and, where an SDPA backend measured fastest, replaces the op by that backend's call
(the mask and bias folded into one additive ``attn_mask``); where no kernel ran on the GPU at all
(``"math"``), by the attention as user code computes it. The report's match says what was chosen.
On CPU the tuner always answers ``"opsmath"``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import aten, hinted, size_hint
from opsmath.kernels.attention.tuning import backend_for, eager_same_dtype, fold_bias, sdpa
from opsmath.rewrite.match import RewriteContext

MATCH = "opsmath_attention_match"   # node meta: the index in ctx.matches of the match that emitted it
LAYOUT = "opsmath_attention_layout"  # node meta: the replaced output's dims, outermost in memory first


def _shape(node):
    return hinted(node.meta["val"]).shape if isinstance(node, fx.Node) else None


def choose_backends(ctx: RewriteContext) -> None:
    """Give each emitted ``opsmath::attention`` the backend measured fastest for its shapes."""
    for node in list(ctx.graph.find_nodes(op="call_function", target=torch.ops.opsmath.attention.default)):
        if MATCH not in node.meta:
            continue
        q, k, v, bias, mask, fill, causal, scale, dropout_p, seed, softcap, window = node.args
        backend = backend_for(hinted(q.meta["val"]), hinted(k.meta["val"]), _shape(bias), _shape(mask), fill, causal,
                              scale, dropout_p, bias is not None and ctx.may_require_grad(bias), softcap, window)
        match = ctx.matches[node.meta[MATCH]]
        match.details["backend"] = backend
        layout = node.meta.get(LAYOUT)
        if backend == "math":
            outs = [_to_math(ctx, node, match)]
        elif backend != "opsmath":
            outs = [_to_sdpa(ctx, node, backend, match)]
        else:
            outs = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
        for out in outs if layout is not None else ():
            _keep_layout(ctx, out, layout)


def dim_order(val) -> tuple:
    """``val``'s dims from outermost to innermost in memory (ties, size-1 dims among them, by index)."""
    stride = [size_hint(x) for x in val.stride()]
    return tuple(sorted(range(len(stride)), key=lambda d: (-stride[d], d)))


def _keep_layout(ctx: RewriteContext, out: fx.Node, order: tuple) -> None:
    """Give ``out``'s readers its values in the memory order ``order`` of the output it replaced.

    Why: a captured SDPA call's output is [B, H, S, D] laid out as [B, S, H, D] (flash, cuDNN, CPU), so
    the user's ``y.transpose(1, 2).contiguous()`` is a no-op the capture drops, and the ``view`` after it
    is only valid in that layout. A kernel returning contiguous [B, H, S, D] gets one copy into it
    (``permute -> clone -> permute back``); nothing is inserted where the layouts agree (size-1 dims
    aside)."""
    val = out.meta.get("val")
    if val is None:
        return
    shape = hinted(val).shape
    if [d for d in dim_order(val) if shape[d] != 1] == [d for d in order if shape[d] != 1]:
        return
    inv = tuple(order.index(d) for d in range(len(order)))
    readers = list(out.users)
    with ctx.graph.inserting_after(out):
        p = ctx.call(aten.permute.default, (out, list(order)), out)
    with ctx.graph.inserting_after(p):
        c = ctx.call(aten.clone.default, (p,), out, {"memory_format": torch.contiguous_format})
    with ctx.graph.inserting_after(c):
        back = ctx.call(aten.permute.default, (c, list(inv)), out)
    for r in readers:
        r.replace_input_with(out, back)


def _to_sdpa(ctx: RewriteContext, node: fx.Node, backend: str, match) -> fx.Node:
    """Replace ``node`` (and its ``getitem(node, 0)`` readers) by ``backend``'s SDPA call; returns it."""
    q, k, v, bias, mask, fill, causal, scale, dropout_p, seed, softcap, window = node.args
    present = set(ctx.graph.nodes)
    with ctx.graph.inserting_before(node):
        vb = None
        if bias is not None or mask is not None or window:
            vb = ctx.call(fold_bias, (bias, mask, causal, ctx.size(q, -2), ctx.size(k, -2), window,
                                      q.meta["val"].device), node)
        out = ctx.call(sdpa, (q, k, v, vb, causal and vb is None, scale, dropout_p, backend), node)
    _replace(ctx, node, out, seed, match, present)
    match.replacement = f"{backend}(" + match.replacement.split("(", 1)[1] + ", measured fastest"
    return out


def _to_math(ctx: RewriteContext, node: fx.Node, match) -> fx.Node:
    """Replace ``node`` by the attention as user code computes it (``eager_same_dtype``: scores and P @ V in
    q's dtype, softmax in fp32, the S x S probabilities materialized), where no kernel ran on this GPU."""
    q, k, v, bias, mask, fill, causal, scale, dropout_p, seed, softcap, window = node.args
    present = set(ctx.graph.nodes)
    with ctx.graph.inserting_before(node):
        out = ctx.call(eager_same_dtype, (q, k, v, bias, mask, fill, causal, scale, dropout_p, seed, softcap, window),
                       node)
    _replace(ctx, node, out, None, match, present)
    match.replacement = ("attention as written (" + match.replacement.split("(", 1)[1]
                         + ": no kernel ran for these shapes on this GPU")
    return out


def _replace(ctx: RewriteContext, node: fx.Node, out: fx.Node, seed, match, present: set) -> None:
    """``out`` for ``node``'s ``getitem(node, 0)`` readers; ``node`` (and a ``seed`` nobody reads) erased."""
    for user in list(node.users):
        assert user.target is operator.getitem and user.args[1] == 0, user.format_node()
        user.replace_all_uses_with(out)
        ctx.graph.erase_node(user)
    ctx.graph.erase_node(node)
    if isinstance(seed, fx.Node):
        ctx.erase_dead([seed])
    alive = {n.name for n in ctx.graph.nodes}
    match.inserted = [n for n in match.inserted if n in alive] + [n.name for n in ctx.graph.nodes if n not in present]
