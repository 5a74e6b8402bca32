"""Attention: ``matmul -> [scale | bias | mask]* -> softmax -> [cast] -> [dropout] -> matmul`` to
``opsmath::attention``.

Anchored on every last-dim softmax (the chain is read by ``chain.py``) and on every
``scaled_dot_product_attention`` call. The score modifications are composed into the kernel's
canonical form ``where(mask, fill, scale * Q K^T + bias)`` (see ``src/opsmath/kernels/attention/__init__.py``); constant
masks (a sliced ``tril`` buffer, HF's arange-built masks) that equal ``j > i`` become ``is_causal``, and
a sliding window's ``j <= i - w`` becomes ``window=w`` (the kernels skip the blocks either removes).
GQA's ``repeat_kv`` (unsqueeze/expand/reshape, ``repeat_interleave``) is undone so K/V are read per
kv head. Every intermediate must be used only inside the chain, or the occurrence is declined.
"""
from __future__ import annotations

import operator
from typing import Optional, Union

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import SOFTMAXES, SDPAS, aten, dtype, is_op, sdpa_args, shape
from opsmath.kernels.attention import SOFTCAP_INDUCTOR_HEAD_DIM
from opsmath.rewrite.match import RewriteContext, node_line
from opsmath.rewrite.rules import Rule, register_rule

from opsmath.patterns.attention.backend import LAYOUT, MATCH, choose_backends, dim_order
from opsmath.patterns.attention.chain import analyze_chain
from opsmath.patterns.attention.flat import flat_bias_rows
from opsmath.patterns.attention.plan import Plan, bias_shape, finish_plan, line_up
from opsmath.patterns.attention.sinks import pad_for_sink, with_sink


def _written_between(plan: Plan) -> Optional[fx.Node]:
    """An in-place op outside the chain, between its QK^T and its P V (graph order), that writes a tensor a
    chain node before it read (the same tensor or a view of the same base): eager read the old values, the
    fused op (emitted at P V) would read the new ones. A write before every read (DeBERTa builds its
    relative bias with ``score += c2p``) is what eager read too."""
    chain = {plan.qk, plan.pv, *plan.nodes}
    node, read = plan.qk, set()
    while node is not plan.pv and node.op != "output":
        t = node.target
        if node in chain:
            read.update(_root(x) for x in node.all_input_nodes)
        elif isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable and t is not aten.detach_.default:
            written = [_root(a) for a, arg in zip(node.args, t._schema.arguments)
                       if isinstance(a, fx.Node) and arg.alias_info is not None and arg.alias_info.is_write]
            if any(w in read for w in written):
                return node
        node = node.next
    return None


def _bias_written_after(plan: Plan) -> Optional[fx.Node]:
    """An in-place op after P V that writes a bias the chain adds (or a tensor it views): eager's ``add``
    kept no reference to it, but the fused op saves it for its backward, which would then fail autograd's
    version check (or read the new values)."""
    biases = {_root(b) for b, _ in plan.biases if isinstance(b, fx.Node)}
    node = plan.pv.next
    while biases and node.op != "output":
        t = node.target
        if isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable and t is not aten.detach_.default and any(
                _root(a) in biases for a, arg in zip(node.args, t._schema.arguments)
                if isinstance(a, fx.Node) and arg.alias_info is not None and arg.alias_info.is_write):
            return node
        node = node.next
    return None


def _root(n: fx.Node) -> fx.Node:
    """The tensor ``n`` is a view of (through ops whose result aliases their first argument), or ``n``."""
    while n.op == "call_function" and (n.target is operator.getitem or isinstance(n.target, torch._ops.OpOverload)
                                       and n.target._schema.arguments and n.target._schema.arguments[0].alias_info
                                       is not None and any(r.alias_info is not None for r in n.target._schema.returns)) \
            and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


class AttentionRule(Rule):
    name = "attention"
    anchors = (*SOFTMAXES, *SDPAS)    # the softmax of a written-out chain, or an SDPA call
    dynamic_shapes = True    # applies to graphs with symbolic sizes (the backend is tuned for the sizes seen)

    def match(self, ctx: RewriteContext, anchor: fx.Node) -> Union[None, str, Plan]:
        plan = analyze_chain(ctx, anchor) if is_op(anchor, SOFTMAXES) else self._analyze_sdpa(ctx, anchor)
        if isinstance(plan, Plan) and plan.softcap and ctx.inductor and shape(plan.q)[-1] > SOFTCAP_INDUCTOR_HEAD_DIM:
            return (f"logit softcap at head dim {shape(plan.q)[-1]}: opsmath's kernel is measured faster than "
                    f"Inductor's compiled chain up to head dim {SOFTCAP_INDUCTOR_HEAD_DIM} only")
        if isinstance(plan, Plan) and (w := _written_between(plan)) is not None:
            return (f"{w.name} writes in place between the scores and P V: the fused op, at P V, would read "
                    "its operands after the write")
        if isinstance(plan, Plan) and (w := _bias_written_after(plan)) is not None:
            return (f"{w.name} writes the bias in place after attention: the fused op keeps the bias for its "
                    "backward, where eager's add kept none")
        if isinstance(plan, Plan) and ctx.inductor and not ctx.budget \
                and any(ctx.may_require_grad(b) for b, _ in plan.biases):
            return ("a bias that needs its gradient (a learned position bias): opsmath's kernel measured slower "
                    "than Inductor's compiled chain (T5, H200: 0.79x); rewritten under a memory budget, where it "
                    "saves the S x S probabilities")
        return plan

    def emit(self, ctx: RewriteContext, anchor: fx.Node, plan: Plan) -> None:
        self._emit(ctx, anchor, plan)

    def finalize(self, ctx: RewriteContext) -> None:
        choose_backends(ctx)   # measures kernels on the GPU: after matching, which stays pure

    def _analyze_sdpa(self, ctx: RewriteContext, node: fx.Node) -> Union[None, str, Plan]:
        """An SDPA call as a plan: ``attn_mask`` a boolean keep-mask (a mask with fill -inf) or an
        additive bias, read like the eager spellings' masks (constant causal masks become ``is_causal``);
        ``enable_gqa`` or a ``repeat_kv`` before the call becomes native GQA; ``scale=None`` is
        ``1/sqrt(D)``. Only the SDPA node is replaced."""
        a = sdpa_args(node)
        q, k, v, m = a["query"], a["key"], a["value"], a["attn_mask"]
        if not all(isinstance(x, fx.Node) for x in (q, k, v)) or not isinstance(m, (fx.Node, type(None))):
            return None
        nd = len(shape(q))
        if nd not in (3, 4) or not isinstance(a["dropout_p"], (int, float)):
            return None
        D, Sk = shape(q)[-1], shape(k)[-2]
        scale = a["scale"] if a["scale"] is not None else D ** -0.5
        if not isinstance(scale, (int, float)) or scale <= 0:
            return "scale is not a positive constant"
        plan = Plan(qk=node, pv=node, q=q, k=k, k_needs_transpose=False, v=v, scale=float(scale),
                     causal=bool(a["is_causal"]), dropout_p=float(a["dropout_p"]), scores=shape(q)[:-1] + (Sk,))
        if a["enable_gqa"] and nd == 4 and shape(k)[1] != shape(q)[1]:
            if shape(q)[1] % shape(k)[1]:
                return "K/V heads do not divide the query heads"
            plan.rep = shape(q)[1] // shape(k)[1]
        if m is not None:
            if dtype(m) == torch.bool:
                plan.masks.append((m, True))   # SDPA's True keeps a position; ours removes it
            else:
                plan.biases.append([m, 1.0])
        if plan.causal and m is not None:
            return "is_causal together with attn_mask"
        if not 0.0 <= plan.dropout_p < 1.0:
            return f"dropout p={plan.dropout_p} outside [0, 1)"
        if (why := line_up(plan)) is not None:
            return why
        return finish_plan(ctx, plan)

    # ------------------------------------------------------------------------------------------
    def _emit(self, ctx: RewriteContext, sm: fx.Node, plan: Plan) -> None:
        """Replace the chain (or the SDPA call) anchored at ``sm`` with ``opsmath::attention`` (its
        backend is chosen after matching, ``finalize``)."""
        nd, pv = len(plan.scores), plan.pv
        chain = list(dict.fromkeys([plan.qk, *plan.nodes, pv]))
        before = [node_line(n) for n in chain]
        with ctx.graph.inserting_before(pv):
            q, k, v = _operands(ctx, sm, plan)
            bias, mask = _bias(ctx, sm, plan), _mask(ctx, sm, plan)
            if plan.sink is not None:   # one more key and a dummy query row (sinks.py)
                q, k, v = with_sink(ctx, sm, q, k, v, plan.sink, plan.scale)
                bias, mask = (pad_for_sink(ctx, sm, x, plan.scores[-1]) for x in (bias, mask))
            seed = ctx.dropout_seed(plan.dropout_p, q, sm)
            res = ctx.call(torch.ops.opsmath.attention.default,
                           (q, k, v, bias, mask, plan.fill, plan.causal, plan.scale, plan.dropout_p, seed,
                            plan.softcap, plan.window), sm)
            res.meta[MATCH] = len(ctx.matches)   # the match recorded below; its backend is chosen after matching
            order = dim_order(pv.meta["val"]) if nd == 4 and not plan.flat_out and isinstance(
                pv.meta.get("val"), torch.Tensor) else None
            dv, cut = shape(plan.v)[-1], plan.sink is not None or shape(plan.v)[-1] < shape(plan.q)[-1]
            if order is not None and not cut:
                res.meta[LAYOUT] = order   # kept by the backend pass (_keep_layout)
            out = ctx.call(operator.getitem, (res, 0), sm)
            if cut:   # V zero-padded (or a sink's dummy row added): the real rows and columns, densely
                out = _narrowed(ctx, sm, out, dv, order or (0, 1, 2, 3), int(plan.sink is not None))
            if nd == 3:
                out = ctx.call(aten.squeeze.dim, (out, 1), sm)
            if plan.flat_out:
                out = ctx.call(aten.flatten.using_ints, (out, 0, 1), sm)
        pv.replace_all_uses_with(out)
        ctx.erase_dead([pv])
        desc, details = _describe(plan)
        ctx.replaced(self.name, sm, chain, f"opsmath::attention({', '.join(desc)})", before, backend="opsmath",
                     **details)


def _to4d(ctx: RewriteContext, sm: fx.Node, plan: Plan, x: fx.Node, rank: int) -> fx.Node:
    """A bias or mask of ``rank`` dims as [B|1, H|1, Sq, Sk]: leading broadcast dims, then a head dim
    for 3-D scores."""
    nd = len(plan.scores)
    for _ in range(nd - rank):
        x = ctx.call(aten.unsqueeze.default, (x, 0), sm)
    return ctx.call(aten.unsqueeze.default, (x, 1), sm) if nd == 3 else x


def _operands(ctx: RewriteContext, sm: fx.Node, plan: Plan) -> tuple:
    """q, k, v in the scores' dtype, k as [.., Sk, D], with a head dim for 3-D scores. Head dims that
    differ (DeepSeek's MLA: Q/K 192, V 128; LeViT: Q/K 16, V 64) are zero-padded to the larger one:
    zero columns of Q and K add exact zeros to every score, zero columns of V give zero output columns
    (cut off after the kernel, ``_narrowed``), and the pads' gradients drop the padded columns."""
    cdt = dtype(plan.qk)
    q, k, v = plan.q, plan.k, plan.v
    if plan.k_needs_transpose:
        k = ctx.call(aten.transpose.int, (k, -2, -1), sm)
    q, k, v = (ctx.cast(x, cdt, sm) for x in (q, k, v))
    for t, how in plan.q_scales:   # a score row's scale is its query's (``chain._tensor_scale``)
        q = ctx.call(how, (q, ctx.cast(t, cdt, sm)), sm)
    d, dv = shape(plan.q)[-1], shape(plan.v)[-1]
    if dv < d:
        v = ctx.call(aten.constant_pad_nd.default, (v, [0, d - dv]), sm)
    elif dv > d:
        q, k = (ctx.call(aten.constant_pad_nd.default, (x, [0, dv - d]), sm) for x in (q, k))
    if len(plan.scores) == 3:
        q, k, v = (ctx.call(aten.unsqueeze.default, (x, 1), sm) for x in (q, k, v))
    return q, k, v


def _narrowed(ctx: RewriteContext, sm: fx.Node, out: fx.Node, dv: int, order: tuple, first_row: int = 0) -> fx.Node:
    """The first ``dv`` columns of the 4-D output ``out`` from query row ``first_row`` on, copied densely
    in the memory order ``order`` of the output they replace (a reader's ``view`` needs it; see
    ``_keep_layout``)."""
    cut = ctx.call(aten.slice.Tensor, (out, -1, 0, dv), sm)
    if first_row:
        cut = ctx.call(aten.slice.Tensor, (cut, 2, first_row, shape(out)[2]), sm)
    p = ctx.call(aten.permute.default, (cut, list(order)), sm)
    c = ctx.call(aten.clone.default, (p,), sm, {"memory_format": torch.contiguous_format})
    return ctx.call(aten.permute.default, (c, [order.index(d) for d in range(4)]), sm)


def _bias(ctx: RewriteContext, sm: fx.Node, plan: Plan):
    """The sum of the plan's additive biases (each times its multiplier), 4-D, or None."""
    bias = None
    for b, mult in plan.biases:
        if plan.flat_rows and flat_bias_rows(b, plan.scores[1]):
            b = ctx.call(aten.unflatten.int, (b, 0, [-1, plan.scores[1]]), sm)
        if len(shape(b)) == 5:   # per window (1, W|1, H|1, N, N): repeated over the A images of A*W rows
            s, merged = shape(b), list(bias_shape(plan, b))
            if s[1] > 1:
                b = ctx.call(aten.expand.default, (b, [plan.scores[0] // s[1], *s[1:]]), sm)
            b = ctx.call(aten.reshape.default, (b, merged), sm)
        if plan.autocast and b.meta["val"].is_floating_point():   # autocast rounds SDPA's float mask
            b = ctx.cast(b, dtype(plan.qk), sm)
        term = b if mult == 1.0 else ctx.call(aten.mul.Tensor, (b, mult), sm)
        bias = term if bias is None else ctx.call(aten.add.Tensor, (bias, term), sm)
    if bias is None:
        return None
    return _to4d(ctx, sm, plan, bias, max(len(bias_shape(plan, b)) for b, _ in plan.biases))


def _mask(ctx: RewriteContext, sm: fx.Node, plan: Plan):
    """The union of the plan's boolean masks (True = filled), 4-D, or None."""
    mask = None
    for m, negate in plan.masks:
        term = ctx.call(aten.logical_not.default, (m,), sm) if negate else m
        mask = term if mask is None else ctx.call(aten.logical_or.default, (mask, term), sm)
    return None if mask is None else _to4d(ctx, sm, plan, mask, max(len(shape(m)) for m, _ in plan.masks))


def _describe(plan: Plan) -> tuple[list, dict]:
    """The report's description of an attention rewrite and its details."""
    nd = len(plan.scores)
    H = plan.scores[1] if nd == 4 else 1
    desc = [f"scale={plan.scale:.4g}"] + ([f"softcap={plan.softcap:.4g}"] if plan.softcap else [])
    desc += ["causal"] if plan.causal else []
    desc += [f"window={plan.window}"] if plan.window else []
    desc += [f"window {plan.window_in_mask} kept in the finite-fill mask, not skipped"] if plan.window_in_mask else []
    desc += ["bias" + str(tuple(shape(b[0]))) for b in plan.biases]
    desc += [f"mask(fill={plan.fill:.3g})"] if plan.masks else []
    desc += [f"dropout={plan.dropout_p:g}"] if plan.dropout_p else []
    desc += [f"gqa {H}/{H // plan.rep}"] if plan.rep > 1 else []
    d, dv = shape(plan.q)[-1], shape(plan.v)[-1]
    desc += [f"head dims q/k {d}, v {dv}: zero-padded to {max(d, dv)}"] if d != dv else []
    desc += ["sinks (one more key)"] if plan.sink is not None else []
    desc += [f"rows {'scaled' if how is aten.mul.Tensor else 'divided'} by {tuple(shape(t))}" for t, how in plan.q_scales]
    return desc, dict(causal=plan.causal, window=plan.window, window_in_mask=plan.window_in_mask, scale=plan.scale,
                      softcap=plan.softcap, dropout_p=plan.dropout_p,
                      gqa_rep=plan.rep, has_bias=bool(plan.biases), has_mask=bool(plan.masks),
                      batch=plan.scores[0], heads=H, q_len=plan.scores[-2], k_len=plan.scores[-1],
                      head_dim=shape(plan.q)[-1], dtype=str(dtype(plan.qk)).replace("torch.", ""))


PATTERN = register_rule(AttentionRule())
