"""The attention family's pass after matching: which kernel each ``opsmath::attention`` runs.

Matching and emitting are pure: the rule always emits ``opsmath::attention`` and marks the node with
its match (``meta[MATCH]``). Once every rule has run, ``choose_backends`` asks the tuner
(``kernels.attention_tuning.backend_for``, which measures the candidates on the GPU for these shapes and
caches the answer) and, where an SDPA backend measured fastest, replaces the op by that backend's call
(the mask and bias folded into one additive ``attn_mask``). The report's match says what was chosen.
On CPU the tuner always answers ``"opsmath"``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from opsmath.canonicalize import hinted
from opsmath.kernels.attention_tuning import backend_for, fold_bias, sdpa
from opsmath.match import RewriteContext

MATCH = "opsmath_attention_match"   # node meta: the index in ctx.matches of the match that emitted it


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
        if backend != "opsmath":
            _to_sdpa(ctx, node, backend, match)


def _to_sdpa(ctx: RewriteContext, node: fx.Node, backend: str, match) -> None:
    """Replace ``node`` (and its ``getitem(node, 0)`` readers) by ``backend``'s SDPA call."""
    q, k, v, bias, mask, fill, causal, scale, dropout_p, seed, softcap, window = node.args
    present = set(ctx.graph.nodes)
    with ctx.graph.inserting_before(node):
        vb = None
        if bias is not None or mask is not None or window:
            vb = ctx.call(fold_bias, (bias, mask, causal, ctx.size(q, -2), ctx.size(k, -2), window,
                                      q.meta["val"].device), node)
        out = ctx.call(sdpa, (q, k, v, vb, causal and vb is None, scale, dropout_p, backend), node)
    for user in list(node.users):
        assert user.target is operator.getitem and user.args[1] == 0, user.format_node()
        user.replace_all_uses_with(out)
        ctx.graph.erase_node(user)
    ctx.graph.erase_node(node)
    if isinstance(seed, fx.Node):
        ctx.erase_dead([seed])
    match.replacement = f"{backend}(" + match.replacement.split("(", 1)[1] + ", measured fastest"
    alive = {n.name for n in ctx.graph.nodes}
    match.inserted = [n for n in match.inserted if n in alive] + [n.name for n in ctx.graph.nodes if n not in present]
