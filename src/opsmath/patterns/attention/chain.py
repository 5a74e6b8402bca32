"""The written-out attention chain, ``matmul -> [scale | bias | mask]* -> softmax -> [cast] ->
[dropout] -> matmul``, read into a ``Plan`` from its softmax.

Walking up from the softmax collects, in order, the ops applied to the scores ``Q K^T``: scalar scales
(``*c``, ``/c``, on the scores, on q or on k), additive biases (HF's ``finfo.min`` masks, ALiBi/relative
biases), ``masked_fill`` and ``where`` masks, casts, and one ``tanh`` between scalar scales (Gemma-2's
logit softcapping ``c * tanh(S / c)``). Walking down collects casts and one dropout up to
the matmul with V. The ops are then composed into the plan's scale, biases and masks. Every
intermediate must be used only inside the chain, or the occurrence is declined.
"""
from __future__ import annotations

from typing import Optional, Union

import torch.fx as fx

from opsmath.rewrite.canonicalize import (aten, as_matmul, constant_value, dropout_info, last_two_transposed,
                                          passes_through, private_temporary, scalar_scale, shape, strip_scales)
from opsmath.rewrite.match import RewriteContext

from opsmath.patterns.attention.flat import flat_pv, flat_scores, rows_scores, rows_to_heads, unflattened
from opsmath.patterns.attention.sinks import drops_sink, is_row_max_of, row_max_shift, sink_column, sink_reason
from opsmath.patterns.attention.plan import Plan, fill_value, finish_plan, line_up


def analyze_chain(ctx: RewriteContext, sm: fx.Node) -> Union[None, str, Plan]:
    """The plan of the chain around softmax ``sm``; a reason to leave it alone; or None (not attention)."""
    sshape = shape(sm)
    nd = len(sshape)
    dim = sm.args[1] if len(sm.args) > 1 else sm.kwargs.get("dim")
    if nd not in (3, 4) or dim % nd != nd - 1:
        return None
    found = _upward(ctx, sm.args[0])
    if found is None or isinstance(found, str):
        return found
    ops, up, qk = found
    if (fs := flat_scores(qk) or (rows_scores(qk) if nd == 3 else None)) is not None:   # alpha QK^T + beta bias
        ops += ([("bias", fs["bias"], fs["beta"])] if fs["beta"] else []) + [("scale", fs["alpha"])]   # beta 0: unread
    found = _downward(sm)
    if isinstance(found, str):
        return found
    down, pv, p_drop = found
    sink = any(op[0] == "sink" for op in ops)
    if sink != any(drops_sink(n) for n in down):
        return "a sink column not cut after the softmax" if sink else "attention probabilities sliced"
    scores = sshape[:-1] + (sshape[-1] - 1,) if sink else sshape   # without the sink's column
    plan = _operands(ctx, qk, fs, pv, p_drop, [*reversed(up), sm, *down], scores,
                     any(rows_to_heads(n) is not None for n in up))
    if isinstance(plan, str):
        return plan
    if (why := line_up(plan)) is not None:
        return why
    if (why := _compose(plan, ops)) is not None:
        return why
    plan = finish_plan(ctx, plan)
    return (sink_reason(plan) or plan) if not isinstance(plan, str) else plan


def _upward(ctx: RewriteContext, cur):
    """From the softmax's input up to Q K^T: (the score ops met, the nodes passed, the QK^T node)."""
    ops, up, escape = [], [], None
    rows = isinstance(cur, fx.Node) and len(shape(cur)) == 3   # 3-D scores: a (B*H)-row baddbmm ends the walk
    while as_matmul(cur) is None and flat_scores(cur) is None and not (rows and rows_scores(cur) is not None):
        if not isinstance(cur, fx.Node) or cur.op != "call_function":
            return None
        if len([u for u in cur.users if not is_row_max_of(u, cur)]) != 1 and escape is None:
            escape = cur
        up.append(cur)
        step = _score_op(ctx, cur)
        if step is None or isinstance(step, str):
            return step
        cur, op = step
        if op is not None:
            ops.append(op)
    if escape is not None:
        return f"{escape.name} (an intermediate of the scores) is used outside the attention"
    if len(cur.users) != 1:
        return f"the scores {cur.name} are used outside the attention"
    return ops, up, cur


def _score_op(ctx: RewriteContext, cur: fx.Node):
    """One op on the scores: (its input on the scores' side, the op as ``("scale", c)``,
    ``("bias", node, sign)``, ``("mask", cond, negate, fill)`` or None), a reason, or None."""
    t, a = cur.target, cur.args
    if passes_through(cur):
        return a[0], None
    if (rows := rows_to_heads(cur)) is not None:   # (B*H)-row scores seen as 4-D: biases above it unflatten
        return rows, None
    if (s := scalar_scale(cur)) is not None:
        return s[0], ("scale", s[1])
    if t is aten.tanh.default:
        return a[0], ("tanh",)
    if (x := row_max_shift(cur)) is not None:   # a per-row shift: the softmax does not see it
        return x, None
    if (cs := sink_column(cur)) is not None and leads_to_matmul(cs[0]):   # GPT-OSS's attention sinks
        return cs[0], ("sink", cs[1])
    if t in (aten.mul.Tensor, aten.div.Tensor) and all(isinstance(x, fx.Node) for x in a[:2]):
        return _tensor_scale(cur)
    if t in (aten.add.Tensor, aten.sub.Tensor) and all(isinstance(x, fx.Node) for x in a[:2]) \
            and cur.kwargs.get("alpha", 1) == 1:
        return _bias_op(cur)
    if t in (aten.add_.Tensor, aten.sub_.Tensor) and all(isinstance(x, fx.Node) for x in a[:2]) \
            and cur.kwargs.get("alpha", 1) == 1 and _private(a[0]) and leads_to_matmul(a[0]):
        # ``scores += bias`` on scores nothing else reads (older T5, custom blocks): the same value
        return a[0], ("bias", a[1], -1.0 if t is aten.sub_.Tensor else 1.0)
    if t in (aten.add.Tensor, aten.sub.Tensor) and isinstance(a[1], (int, float)):
        return a[0], None  # a constant shift of every score: softmax is invariant to it
    if (merged := _windows_merged(cur)) is not None:   # Swin: a mask added per window, then merged back
        return merged
    if t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor) or t in (aten.masked_fill_.Scalar,
                                                                        aten.masked_fill_.Tensor) \
            and _private(a[0]) and leads_to_matmul(a[0]):   # in place: on scores nothing else reads
        f = fill_value(ctx, a[2])
        return "masked_fill value is not a constant" if f is None else (a[0], ("mask", a[1], False, f))
    if t in (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf):
        return _where_op(ctx, cur)
    return _unsupported(cur)


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _windows_merged(cur: fx.Node):
    """Swin's shifted-window mask: ``view(view(S, (A, W, H, N, N)) + m, (A*W, H, N, N))``, the scores of
    A images x W windows split per window, a (1, W|1, H|1, N, N) bias ``m`` added, merged back. Returns
    (S, the bias op with ``m`` 5-D, folded to 4-D at emission: ``plan.bias_shape``), a reason,
    or None for any other op."""
    x = cur.args[0] if cur.args else None
    if cur.target not in _VIEWS or len(shape(cur)) != 4 or not isinstance(x, fx.Node) \
            or x.target is not aten.add.Tensor or len(x.users) != 1 or len(shape(x)) != 5:
        return None
    s5 = shape(x)
    if s5[0] * s5[1] != shape(cur)[0] or s5[2:] != shape(cur)[1:]:
        return None
    for split, m in (x.args[:2], x.args[1::-1]):
        if isinstance(split, fx.Node) and split.target in _VIEWS and len(split.users) == 1 \
                and isinstance(m, fx.Node) and shape(split.args[0]) == shape(cur):
            ms = shape(m)
            if len(ms) != 5 or ms[0] != 1 or ms[1] not in (1, s5[1]) or ms[2] not in (1, s5[2]) \
                    or ms[3:] != s5[3:] or not all(isinstance(d, int) for d in (*s5, *ms)):
                return f"a bias of shape {ms} on scores split per window {s5}: not read"
            return split.args[0], ("bias", m, 1.0)
    return None


def _baddbmm_scores(node: fx.Node) -> bool:
    """``baddbmm(bias, q, k^T)`` viewed as (B, H, Sq, Sk): BLOOM's scores with ALiBi inside the GEMM."""
    return node.target is aten.baddbmm.default or (
        node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
        and isinstance(node.args[0], fx.Node) and node.args[0].target is aten.baddbmm.default)


def _unsupported(cur: fx.Node) -> Optional[str]:
    """Score modifications recognized but not fused yet: said in the report instead of silence."""
    if _baddbmm_scores(cur):
        return "scores from baddbmm whose operands are not 4-D tensors flattened to (B*H) rows: not read"
    if (src := unflattened(cur)) is not None:   # XGLM: max(QK^T + mask, finfo.min), then (B*H) rows
        clamped = src.target in _CLAMPS
        if leads_to_matmul(src.args[0] if clamped else src):
            return ("4-D scores flattened to (B*H) rows before the softmax"
                    + (", clamped from below (torch.max with a constant)" if clamped else "") + ": not read")
    return None


_CLAMPS = (aten.max.other, aten.maximum.default, aten.clamp_min.default)


def _tensor_scale(cur: fx.Node):
    """``scores * t`` or ``scores / t`` with ``t`` a tensor constant over the keys (SwinV2's learned per-head
    logit scale, XCiT's temperature, a learned temperature divided by): the scores' rows scaled, i.e. q
    multiplied or divided by ``t`` (``Plan.q_scales``)."""
    first, second = (leads_to_matmul(x) for x in cur.args[:2])
    if first == second or (cur.target is aten.div.Tensor and not first):   # ``t / scores`` is no scale
        return None
    s, t = cur.args[:2] if first else cur.args[1::-1]
    ts = shape(t)
    if len(ts) > len(shape(cur)) or (ts and ts[-1] != 1):
        return "scores multiplied or divided by a tensor that varies over the keys: not read"
    return s, ("tscale", t, cur.target)


IN_PLACE = {aten.add_.Tensor, aten.sub_.Tensor, aten.masked_fill_.Scalar, aten.masked_fill_.Tensor, aten.mul_.Tensor,
            aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar}


def _private(x) -> bool:
    """``x`` is a fresh tensor one op reads (``private_temporary``), or an in-place score op's result on one
    (``s.masked_fill_(a); s.masked_fill_(b)``): writing to it in place is observed by no one else."""
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in IN_PLACE and len(x.users) == 1:
        x = x.args[0]
    return private_temporary(x)


def _bias_op(cur: fx.Node):
    """``scores + b``, ``b + scores`` or ``scores - b``."""
    a = cur.args
    first = leads_to_matmul(a[0])
    if first == leads_to_matmul(a[1]):
        return None
    score, other = (a[0], a[1]) if first else (a[1], a[0])
    if cur.target is aten.sub.Tensor:
        if not first:
            return "scores are subtracted from a tensor (c - QK^T) "
        return score, ("bias", other, -1.0)
    return score, ("bias", other, 1.0)


def _where_op(ctx: RewriteContext, cur: fx.Node):
    """``where(cond, scores, f)`` (masked where cond is False) or ``where(cond, f, scores)``."""
    cond, x, y = cur.args[:3]
    score_is_x = cur.target is aten.where.ScalarOther or (cur.target is aten.where.self and leads_to_matmul(x))
    f = fill_value(ctx, y if score_is_x else x)
    if f is None:
        return "where() fill value is not a constant"
    return (x if score_is_x else y), ("mask", cond, score_is_x, f)


def _downward(sm: fx.Node):
    """From the softmax down to P V: (the nodes passed, the PV node, the dropout p) or a reason."""
    down, cur, p_drop = [], sm, 0.0
    while True:
        users = list(cur.users)
        if len(users) != 1:
            return f"{cur.name} (attention probabilities) is used outside the attention, e.g. returned"
        u = users[0]
        if passes_through(u) or drops_sink(u):
            cur = u
        elif (d := dropout_info(u)) is not None and d[0] is cur:
            if p_drop > 0 and d[1] > 0:
                return "two dropouts on the attention probabilities"
            p_drop = max(p_drop, d[1])
            cur = u
        elif (mm := as_matmul(u)) is not None and mm[0] is cur and not mm[2]:
            break
        elif (flat := flat_pv(cur)) is not None:   # P.view(B*H, Sq, Sk) @ v.reshape(B*H, Sk, D)
            down.append(flat[0])
            u = flat[1]
            break
        else:
            return f"attention probabilities feed {getattr(u.target, '__name__', u.target)}, not P @ V"
        down.append(u)
    if not 0.0 <= p_drop < 1.0:
        return f"dropout p={p_drop} outside [0, 1)"
    return down, u, p_drop


def _operands(ctx: RewriteContext, qk: fx.Node, fs: Optional[dict], pv: fx.Node, p_drop: float, nodes: list,
              scores: tuple, flat_rows: bool) -> Union[str, Plan]:
    """Q, K (un-transposed where the chain transposed it), V and the scales on q and k (numbers, or one-
    element constant tensors); for (B*H)-row scores (``flat_rows``) the 4-D tensors Q and K came from."""
    v, flat_out = as_matmul(pv)[1], unflattened(pv.args[0]) is not None   # P V over (B*H) rows: 4-D v
    if flat_out and unflattened(v) is not None:
        v = unflattened(v)
    # scales from literal tensors only (no buffers: a buffer's value may change between steps)
    const = lambda n: constant_value(ctx.gm, n, {})  # noqa: E731
    if fs is not None and fs.get("rows"):   # nn.MultiheadAttention's baddbmm over (B*H) rows (``rows_scores``)
        (q, cq), (k, ck) = strip_scales(fs["q"], const), strip_scales(fs["k"], const)
        return Plan(qk=qk, pv=pv, q=q, k=k, k_needs_transpose=False, v=v, dropout_p=p_drop, scale=cq * ck,
                    nodes=nodes, scores=scores, flat_out=flat_out)
    if fs is not None:   # the scores are BLOOM's baddbmm (``flat_scores``)
        return Plan(qk=qk, pv=pv, q=fs["q"], k=fs["k"], k_needs_transpose=False, v=v, dropout_p=p_drop,
                    nodes=nodes, scores=scores, flat_rows=True, flat_out=flat_out)
    a, b, b_transposed = as_matmul(qk)
    q, cq = strip_scales(a, const)
    b, cb = strip_scales(b, const)
    kt = b if b_transposed else last_two_transposed(b)
    k, ck = strip_scales(kt if kt is not None else b, const)
    if flat_rows:
        q, k = unflattened(q), (unflattened(k) if kt is not None else None)
        if q is None or k is None:
            return "scores over (B*H) rows whose Q or K has no 4-D (batch, head) source"
    return Plan(qk=qk, pv=pv, q=q, k=k, k_needs_transpose=kt is None, v=v, dropout_p=p_drop,
                scale=cq * cb * ck, nodes=nodes, scores=scores, flat_rows=flat_rows, flat_out=flat_out)


def _compose(plan: Plan, ops: list) -> Optional[str]:
    """Fold the score ops (applied innermost first) into the plan's scale, biases and masks. A ``tanh``
    makes the scales after it an outer factor ``m``: ``m * tanh(a * QK^T)`` is the kernel's softcap
    ``c * tanh(scale * QK^T / c)`` with ``c = m`` and ``scale = a * m``."""
    outer = None   # the product of the scales after a tanh
    for op in reversed(ops):
        if plan.sink is not None:
            return "a score op after the sink column (it would reach the sink's logit)"
        if op[0] == "sink":
            plan.sink = op[1]
        elif op[0] == "tscale":
            if plan.biases or plan.masks or outer is not None or plan.flat_rows:
                return "scores scaled by a tensor after a bias, mask or tanh, or over (B*H) rows"
            plan.q_scales.append((op[1], op[2]))
        elif op[0] == "tanh":
            if outer is not None or plan.biases or plan.masks:
                return "tanh on the scores after a bias, mask or another tanh (not a logit softcap)"
            outer = 1.0
        elif op[0] == "scale":
            if op[1] <= 0:
                return "non-positive scale on the scores"
            if outer is None:
                plan.scale *= op[1]
            else:
                outer *= op[1]
            for b in plan.biases:
                b[1] *= op[1]
            if plan.masks:
                plan.fill *= op[1]
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
    if outer is not None:
        plan.softcap, plan.scale = outer, plan.scale * outer
    return None


def leads_to_matmul(node, depth: int = 12) -> bool:
    """Whether ``node`` is (through scales, casts, biases, masks) a product of a matmul."""
    for _ in range(depth):
        if as_matmul(node) is not None:
            return True
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return False
        if _baddbmm_scores(node):
            return True     # recognized so that the chain is declined with its reason (_unsupported)
        if (x := row_max_shift(node)) is not None or (x := sink_column(node)) is not None:
            node = x if isinstance(x, fx.Node) else x[0]
            continue
        if passes_through(node) or scalar_scale(node) is not None or node.target is aten.tanh.default \
                or rows_to_heads(node) is not None:
            node = node.args[0]
        elif node.target in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor):
            return any(leads_to_matmul(a, depth - 1) for a in node.args[:2] if isinstance(a, fx.Node))
        elif node.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.ScalarOther,
                             aten.masked_fill_.Scalar, aten.masked_fill_.Tensor, aten.add_.Tensor, aten.sub_.Tensor):
            node = node.args[0]
        elif node.target is aten.where.ScalarSelf:
            node = node.args[2]
        elif node.target is aten.where.self:
            return any(leads_to_matmul(a, depth - 1) for a in node.args[1:3] if isinstance(a, fx.Node))
        else:
            return False
    return False
