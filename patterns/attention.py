"""Attention: ``matmul -> [scale | bias | mask]* -> softmax -> [cast] -> [dropout] -> matmul`` to
``opsmath::attention``.

Anchored on every last-dim softmax. Walking up from it collects, in order, the ops applied to the
scores ``Q K^T``: scalar scales (``*c``, ``/c``, on the scores, on q or on k), additive biases (HF's
``finfo.min`` masks, ALiBi/relative biases), ``masked_fill`` and ``where`` masks, casts. Walking down
collects casts and one dropout up to the matmul with V. The ops are then composed into the kernel's
canonical form ``where(mask, fill, scale * Q K^T + bias)`` (see ``kernels/attention.py``); constant
masks (a sliced ``tril`` buffer, HF's arange-built masks) that equal ``j > i`` become ``is_causal``.
GQA's ``repeat_kv`` (unsqueeze/expand/reshape, ``repeat_interleave``) is undone so K/V are read per
kv head. Every intermediate must be used only inside the chain, or the occurrence is declined.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.fx as fx

from opsmath.canonicalize import (SOFTMAXES, SDPAS, aten, as_matmul, causal_from_constant, constant_value,
                                  dropout_info, dtype, is_cast, is_op, last_two_transposed, repeat_kv_source,
                                  hinted, scalar_scale, sdpa_args, shape, strip_scales, val)
from opsmath.match import RewriteContext, node_line

# a mask fill or additive bias at or below this removes a position exactly (exp underflows to 0 in fp32)
_REMOVES = -1e4


@dataclass
class _Plan:
    qk: fx.Node
    pv: fx.Node
    q: fx.Node
    k: fx.Node                        # (..., Sk, D): already un-transposed
    k_needs_transpose: bool
    v: fx.Node
    rep: int = 1                      # GQA: query heads per kv head (k, v are kv-head tensors)
    scale: float = 1.0
    biases: list = field(default_factory=list)   # [node, multiplier]
    masks: list = field(default_factory=list)    # (node, negate)
    fill: float = float("-inf")
    causal: bool = False
    dropout_p: float = 0.0
    nodes: list = field(default_factory=list)    # chain nodes, in graph order
    scores: tuple = ()                # the scores' shape (..., Sq, Sk)


def _leads_to_matmul(node, depth: int = 12) -> bool:
    """Whether ``node`` is (through scales, casts, biases, masks) a product of a matmul."""
    for _ in range(depth):
        if as_matmul(node) is not None:
            return True
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return False
        if is_cast(node) or scalar_scale(node) is not None:
            node = node.args[0]
        elif node.target in (aten.add.Tensor, aten.sub.Tensor):
            return any(_leads_to_matmul(a, depth - 1) for a in node.args[:2] if isinstance(a, fx.Node))
        elif node.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.ScalarOther):
            node = node.args[0]
        elif node.target is aten.where.ScalarSelf:
            node = node.args[2]
        elif node.target is aten.where.self:
            return any(_leads_to_matmul(a, depth - 1) for a in node.args[1:3] if isinstance(a, fx.Node))
        else:
            return False
    return False


def _shape_or_none(node) -> Optional[tuple]:
    return hinted(node.meta["val"]).shape if node is not None else None


def _fill_value(ctx, x) -> Optional[float]:
    """A mask's fill as a float: a Python number or a constant 0-d/1-element tensor."""
    if isinstance(x, (int, float)):
        return float(x)
    c = constant_value(ctx.gm, x, ctx.constants)
    if c is not None and c.numel() == 1:
        return float(c.reshape(()))
    return None


def _line_up(plan: _Plan) -> Optional[str]:
    """Check (and complete) a plan's operands against its scores' shape: GQA's ``repeat_kv`` undone
    into ``plan.rep`` (unless already set), then shapes, dtypes and devices; a reason to decline or None."""
    lead, Sk, nd = plan.scores[:-2], plan.scores[-1], len(plan.scores)
    q, k, v = plan.q, plan.k, plan.v
    D = shape(q)[-1]
    kshape = shape(k)[:-2] + (shape(k)[-1], shape(k)[-2]) if plan.k_needs_transpose else shape(k)
    if nd == 4 and plan.rep > 1:
        if kshape[0] != lead[0] or kshape[1] * plan.rep != lead[1] or shape(v)[:-2] != kshape[:-2]:
            return "K/V heads do not divide the query heads"
    elif nd == 4 and kshape[:-2] != lead:
        kv = repeat_kv_source(k, lead[1]), repeat_kv_source(v, lead[1])
        if kv[0] is None or kv[1] is None or kv[0][1] != kv[1][1] or plan.k_needs_transpose:
            return f"K/V batch dims {kshape[:-2]} differ from the scores' {lead} in a way not understood"
        (plan.k, plan.rep), (plan.v, _) = kv
        kshape = shape(plan.k)
        if kshape[0] != lead[0] or kshape[1] * plan.rep != lead[1]:
            return "K/V heads do not divide the query heads"
    elif nd == 4 and shape(v)[:-2] != lead:
        return "V batch dims differ from the scores' (K and V repeated differently?)"
    if shape(q)[:-2] != lead or kshape[-2:] != (Sk, D) or shape(plan.v)[-2] != Sk:
        return "Q/K/V shapes do not line up (broadcasting matmul)"
    if shape(plan.v)[-1] != D:
        return f"V head dim {shape(plan.v)[-1]} differs from Q/K head dim {D} (not supported yet)"
    if dtype(plan.qk) != dtype(plan.pv) or dtype(plan.qk) not in (torch.float16, torch.bfloat16, torch.float32,
                                                                  torch.float64):
        return f"mixed or unsupported dtypes: QK^T in {dtype(plan.qk)}, PV in {dtype(plan.pv)}"
    if any(dtype(x) != dtype(plan.qk) for x in (q, plan.k, plan.v)) and plan.qk is plan.pv:
        return "Q, K and V in different dtypes"
    devs = {getattr(val(n), "device", None) for n in (q, plan.k, plan.v, plan.qk)}
    if len(devs) != 1:
        return f"operands on different devices {devs}"
    return None


def _finish_plan(ctx, plan: _Plan) -> Union[str, _Plan]:
    """Biases must broadcast to the scores; constant causal masks and biases become ``is_causal``."""
    for what, x in [("bias", b) for b, _ in plan.biases] + [("mask", m) for m, _ in plan.masks]:
        try:
            ok = torch.broadcast_shapes(shape(x), plan.scores) == plan.scores
        except RuntimeError:
            ok = False
        if not ok:
            return f"{what} of shape {shape(x)} does not broadcast to the scores {plan.scores}"
    AttentionPattern._detect_causal(ctx, plan, *plan.scores[-2:])
    return plan


class AttentionPattern:
    name = "attention"
    dynamic_shapes = True    # applies to graphs with symbolic sizes (the backend is tuned for the sizes seen)

    def apply(self, ctx: RewriteContext) -> None:
        for anchor in [n for n in ctx.graph.nodes if is_op(n, SOFTMAXES) or is_op(n, SDPAS)]:
            plan = self._analyze(ctx, anchor) if is_op(anchor, SOFTMAXES) else self._analyze_sdpa(ctx, anchor)
            if plan is None:
                continue
            ctx.offer(self.name, anchor, plan, lambda: self._emit(ctx, anchor, plan))

    # ------------------------------------------------------------------------------------------
    def _analyze(self, ctx: RewriteContext, sm: fx.Node) -> Union[None, str, _Plan]:
        sshape = shape(sm)
        nd = len(sshape)
        dim = sm.args[1] if len(sm.args) > 1 else sm.kwargs.get("dim")
        if nd not in (3, 4) or dim % nd != nd - 1:
            return None
        # ---- upward: softmax input back to Q K^T ------------------------------------------------
        ops, up, cur, escape = [], [], sm.args[0], None
        while as_matmul(cur) is None:
            if not isinstance(cur, fx.Node) or cur.op != "call_function":
                return None
            if len(cur.users) != 1 and escape is None:
                escape = cur
            up.append(cur)
            t, a = cur.target, cur.args
            if is_cast(cur):
                cur = a[0]
            elif (s := scalar_scale(cur)) is not None:
                ops.append(("scale", s[1]))
                cur = s[0]
            elif t in (aten.add.Tensor, aten.sub.Tensor) and all(isinstance(x, fx.Node) for x in a[:2]) \
                    and cur.kwargs.get("alpha", 1) == 1:
                first = _leads_to_matmul(a[0])
                if first == _leads_to_matmul(a[1]):
                    return None
                score, other = (a[0], a[1]) if first else (a[1], a[0])
                if t is aten.sub.Tensor:
                    if not first:
                        return "scores are subtracted from a tensor (c - QK^T) "
                    ops.append(("bias", other, -1.0))
                else:
                    ops.append(("bias", other, 1.0))
                cur = score
            elif t in (aten.add.Tensor, aten.sub.Tensor) and isinstance(a[1], (int, float)):
                cur = a[0]  # a constant shift of every score: softmax is invariant to it
            elif t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
                f = _fill_value(ctx, a[2])
                if f is None:
                    return "masked_fill value is not a constant"
                ops.append(("mask", a[1], False, f))
                cur = a[0]
            elif t in (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf):
                cond, x, y = a[0], a[1], a[2]
                score_is_x = t is aten.where.ScalarOther or (t is aten.where.self and _leads_to_matmul(x))
                f = _fill_value(ctx, y if score_is_x else x)
                if f is None:
                    return "where() fill value is not a constant"
                # where(cond, scores, f): masked where cond is False
                ops.append(("mask", cond, score_is_x, f))
                cur = x if score_is_x else y
            else:
                return None
        qk = cur
        if escape is not None:
            return f"{escape.name} (an intermediate of the scores) is used outside the attention"
        if len(qk.users) != 1:
            return f"the scores {qk.name} are used outside the attention"
        # ---- downward: softmax to P V --------------------------------------------------------------
        down, cur, p_drop = [], sm, 0.0
        while True:
            users = list(cur.users)
            if len(users) != 1:
                return f"{cur.name} (attention probabilities) is used outside the attention, e.g. returned"
            u = users[0]
            if is_cast(u):
                cur = u
            elif (d := dropout_info(u)) is not None and d[0] is cur:
                if p_drop > 0 and d[1] > 0:
                    return "two dropouts on the attention probabilities"
                p_drop = max(p_drop, d[1])
                cur = u
            elif (mm := as_matmul(u)) is not None and mm[0] is cur and not mm[2]:
                pv = u
                break
            else:
                return f"attention probabilities feed {getattr(u.target, '__name__', u.target)}, not P @ V"
            down.append(u)
        if not 0.0 <= p_drop < 1.0:
            return f"dropout p={p_drop} outside [0, 1)"
        # ---- operands ----------------------------------------------------------------------------
        a, b, b_transposed = as_matmul(qk)
        q, cq = strip_scales(a)
        kt = b if b_transposed else last_two_transposed(b)
        if kt is not None:
            k, ck = strip_scales(kt)
            k_needs_transpose = False
        else:
            k, ck = strip_scales(b)
            k_needs_transpose = True
        v = as_matmul(pv)[1]
        plan = _Plan(qk=qk, pv=pv, q=q, k=k, k_needs_transpose=k_needs_transpose, v=v, dropout_p=p_drop,
                     scale=cq * ck, nodes=[*reversed(up), sm, *down], scores=sshape)
        if (why := _line_up(plan)) is not None:
            return why
        # ---- compose ops (applied innermost first) into scale, bias, mask ---------------------------
        for op in reversed(ops):
            if op[0] == "scale":
                c = op[1]
                if c <= 0:
                    return "non-positive scale on the scores"
                plan.scale *= c
                for b in plan.biases:
                    b[1] *= c
                if plan.masks:
                    plan.fill *= c
            elif op[0] == "bias":
                if plan.masks and plan.fill != float("-inf"):
                    return "a bias is added after a finite mask fill"
                plan.biases.append([op[1], op[2]])
            else:
                _, m, negate, f = op
                if plan.masks and f != plan.fill:
                    return "two masks with different fill values"
                plan.masks.append((m, negate))
                plan.fill = f
        return _finish_plan(ctx, plan)

    def _analyze_sdpa(self, ctx: RewriteContext, node: fx.Node) -> Union[None, str, _Plan]:
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
        plan = _Plan(qk=node, pv=node, q=q, k=k, k_needs_transpose=False, v=v, scale=float(scale),
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
        if (why := _line_up(plan)) is not None:
            return why
        return _finish_plan(ctx, plan)

    @staticmethod
    def _detect_causal(ctx, plan: _Plan, Sq: int, Sk: int) -> None:
        """Constant masks/biases equal to the ``j > i`` pattern become ``is_causal`` (block skipping)."""
        for mask in list(plan.masks):
            m, negate = mask
            c = constant_value(ctx.gm, m, ctx.constants)
            if c is not None and plan.fill <= _REMOVES and causal_from_constant(~c if negate else c, Sq, Sk):
                plan.masks.remove(mask)
                plan.causal = True
        for bias in list(plan.biases):
            c = constant_value(ctx.gm, bias[0], ctx.constants)
            if c is None or not c.is_floating_point():
                continue
            removed = (c * bias[1]) <= _REMOVES
            kept_zero = bool(((c == 0) | removed).all())
            if kept_zero and causal_from_constant(removed, Sq, Sk):
                plan.biases.remove(bias)
                plan.causal = True
        if not plan.masks:
            plan.fill = float("-inf")

    # ------------------------------------------------------------------------------------------
    def _emit(self, ctx: RewriteContext, sm: fx.Node, plan: _Plan) -> None:
        """Replace the chain (or the SDPA call) anchored at ``sm`` with the chosen backend's call."""
        nd = len(plan.scores)
        cdt = dtype(plan.qk)
        pv = plan.pv
        chain = list(dict.fromkeys([plan.qk, *plan.nodes, pv]))
        before = [node_line(n) for n in chain]
        with ctx.graph.inserting_before(pv):
            def cast(x):
                return x if dtype(x) == cdt else ctx.call(aten.to.dtype, (x, cdt), sm)

            def to4d(x, rank):
                for _ in range(nd - rank):  # leading broadcast dims, then a head dim for 3-D scores
                    x = ctx.call(aten.unsqueeze.default, (x, 0), sm)
                return ctx.call(aten.unsqueeze.default, (x, 1), sm) if nd == 3 else x

            q, k, v = plan.q, plan.k, plan.v
            if plan.k_needs_transpose:
                k = ctx.call(aten.transpose.int, (k, -2, -1), sm)
            q, k, v = cast(q), cast(k), cast(v)
            if nd == 3:
                q, k, v = (ctx.call(aten.unsqueeze.default, (x, 1), sm) for x in (q, k, v))
            bias = None
            for b, mult in plan.biases:
                term = b if mult == 1.0 else ctx.call(aten.mul.Tensor, (b, mult), sm)
                bias = term if bias is None else ctx.call(aten.add.Tensor, (bias, term), sm)
            if bias is not None:
                bias = to4d(bias, max(len(shape(b)) for b, _ in plan.biases))
            mask = None
            for m, negate in plan.masks:
                term = ctx.call(aten.logical_not.default, (m,), sm) if negate else m
                mask = term if mask is None else ctx.call(aten.logical_or.default, (mask, term), sm)
            if mask is not None:
                mask = to4d(mask, max(len(shape(m)) for m, _ in plan.masks))
            from opsmath.kernels.attention_tuning import backend_for
            backend = backend_for(hinted(q.meta["val"]), hinted(k.meta["val"]), _shape_or_none(bias), _shape_or_none(mask),
                                  plan.fill, plan.causal, plan.scale, plan.dropout_p,
                                  bias is not None and ctx.may_require_grad(bias))
            if backend == "opsmath":
                seed = ctx.dropout_seed(plan.dropout_p, q, sm)
                res = ctx.call(torch.ops.opsmath.attention.default,
                               (q, k, v, bias, mask, plan.fill, plan.causal, plan.scale, plan.dropout_p, seed), sm)
                out = ctx.call(operator.getitem, (res, 0), sm)
            else:
                from opsmath.kernels.attention_tuning import fold_bias, sdpa
                vb = None
                if bias is not None or mask is not None:
                    vb = ctx.call(fold_bias, (bias, mask, plan.causal, ctx.size(q, -2), ctx.size(k, -2)), sm)
                out = ctx.call(sdpa, (q, k, v, vb, plan.causal and vb is None, plan.scale, plan.dropout_p,
                                      backend), sm)
            if nd == 3:
                out = ctx.call(aten.squeeze.dim, (out, 1), sm)
        pv.replace_all_uses_with(out)
        ctx.erase_dead([pv])
        B = plan.scores[0]
        H = plan.scores[1] if nd == 4 else 1
        desc = [f"scale={plan.scale:.4g}"]
        if plan.causal:
            desc.append("causal")
        if plan.biases:
            desc.append("bias" + str(tuple(shape(plan.biases[0][0]))))
        if plan.masks:
            desc.append(f"mask(fill={plan.fill:.3g})")
        if plan.dropout_p:
            desc.append(f"dropout={plan.dropout_p:g}")
        if plan.rep > 1:
            desc.append(f"gqa {H}/{H // plan.rep}")
        text = f"opsmath::attention({', '.join(desc)})" if backend == "opsmath" else \
            f"{backend}({', '.join(desc)}), measured fastest"
        ctx.replaced(self.name, sm, chain, text, before, backend=backend,
                     causal=plan.causal, scale=plan.scale, dropout_p=plan.dropout_p, gqa_rep=plan.rep,
                     has_bias=bool(plan.biases), has_mask=bool(plan.masks), batch=B, heads=H,
                     q_len=plan.scores[-2], k_len=plan.scores[-1], head_dim=shape(plan.q)[-1],
                     dtype=str(dtype(plan.qk)).replace("torch.", ""))


PATTERN = AttentionPattern()
