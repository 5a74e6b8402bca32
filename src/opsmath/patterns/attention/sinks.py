"""Attention sinks (GPT-OSS): a learned logit ``s_h`` per head joins every row's softmax and its column
is dropped after it,

    P = softmax([S, s_h])[..., :-1],    O = P V,

read from the written-out chain (``cat([scores, sinks], -1)``, the row-max shift HF subtracts, the slice
after the softmax) and run by the same attention kernels as one more key:

* a sink key row is prepended to K, and a dummy query row to Q, so that under a top-left causal mask
  every query still sees the sink and key j stays visible to query i exactly when it was;
* ``SINK_FEATURES`` zero features are appended to Q, K and V; a query's first one holds
  ``s_h / scale``, the sink key's holds 1, every real key's 0: ``q_i . k_sink * scale = s_h`` and every
  real score is unchanged (its extra terms are exact zeros);
* the sink's value row is 0, biases and masks get a visible (0 / False) column for it in front;
* the output drops the dummy row and the added features (``attention._narrowed``).

The gradient of ``s_h`` is the sum of its column's score gradients, through the query feature that
carries it. Exact in real arithmetic. A window the kernel skips would hide the sink from rows past the
window: with a sink, a sliding-window mask stays the mask it was written as (no block skipping,
``finish_plan``). Softcapped chains are declined (the cap would bend the sink's logit too).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch.fx as fx

from opsmath.rewrite.canonicalize import aten, dtype, shape
from opsmath.rewrite.match import RewriteContext

SINK_FEATURES = 8   # extra head-dim features (one carries the logit; 8 keep the head dim a multiple of 8)


def row_max_shift(node: fx.Node) -> Optional[fx.Node]:
    """``x`` if ``node`` is ``x - x.max(-1, keepdim=True).values`` (or ``x.amax(-1, keepdim=True)``):
    a per-row shift the softmax does not see (HF GPT-OSS subtracts it against bf16 overflow)."""
    if node.target is not aten.sub.Tensor or not isinstance(node.args[1], fx.Node):
        return None
    x, m = node.args[:2]
    if m.target is operator.getitem and m.args[1] == 0 and isinstance(m.args[0], fx.Node):
        m = m.args[0]
        if m.target is not aten.max.dim:
            return None
        dims, keep = [m.args[1]], (m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim", False))
    elif m.target is aten.amax.default:
        dims, keep = list(m.args[1]), (m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim", False))
    else:
        return None
    if m.args[0] is not x or not keep or [d % len(shape(x)) for d in dims] != [len(shape(x)) - 1]:
        return None
    return x


def is_row_max_of(user: fx.Node, x: fx.Node) -> bool:
    """``user`` is the row max that ``row_max_shift`` subtracts from ``x``."""
    return user.target in (aten.max.dim, aten.amax.default) and user.args[0] is x


def sink_column(node: fx.Node) -> Optional[tuple]:
    """(scores, sinks) if ``node`` is ``cat([scores, sinks], -1)`` with ``sinks`` one column, else None."""
    if node.target is not aten.cat.default or len(node.args[0]) != 2:
        return None
    s, sinks = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(s, fx.Node) or not isinstance(sinks, fx.Node) or dim % len(shape(node)) != len(shape(node)) - 1 \
            or shape(sinks)[-1] != 1:
        return None
    return s, sinks


def drops_sink(node: fx.Node) -> bool:
    """``node`` is ``p[..., :-1]``: the sink's column cut off after the softmax."""
    if node.target is not aten.slice.Tensor or not isinstance(node.args[0], fx.Node):
        return False
    a = node.args
    x, dim, start = a[0], (a[1] if len(a) > 1 else 0), (a[2] if len(a) > 2 else None)
    end, step, n = (a[3] if len(a) > 3 else None), (a[4] if len(a) > 4 else 1), shape(a[0])[-1]
    return dim % len(shape(x)) == len(shape(x)) - 1 and start in (0, None) and end in (-1, n - 1) and step == 1


def sink_reason(plan) -> Optional[str]:
    """Why a plan with a sink cannot run as one more key, or None."""
    if plan.sink is None:
        return None
    if len(plan.scores) != 4 or plan.flat_rows or plan.flat_out:
        return "attention sinks on scores that are not 4-D (B, H, Sq, Sk)"
    (B, H, Sq, _), s = plan.scores, shape(plan.sink)
    if plan.window or plan.softcap:
        return "attention sinks with a skipped sliding window or a logit softcap: not fused"
    if len(s) != 4 or s[0] not in (1, B) or s[1] not in (1, H) or s[2] not in (1, Sq) or not isinstance(Sq, int):
        return f"attention sinks of shape {s} for scores {plan.scores}"
    return None


def with_sink(ctx: RewriteContext, sm: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node, sinks: fx.Node,
              scale: float) -> tuple:
    """q, k, v (4-D, equal head dims d) as the kernel runs them with the sink key (module docstring):
    (B, H, Sq + 1, d + 8), (Bk, Hkv, Sk + 1, d + 8), (Bk, Hkv, Sk + 1, d + 8)."""
    B, H, Sq, d = shape(q)
    s = ctx.call(aten.expand.default, (sinks, [B, H, Sq, 1]), sm)
    s = ctx.call(aten.mul.Tensor, (s, 1.0 / scale), sm)
    if dtype(s) != dtype(q):
        s = ctx.call(aten.to.dtype, (s, dtype(q)), sm)
    q = ctx.call(aten.cat.default, ([q, s], -1), sm)
    q = ctx.call(aten.constant_pad_nd.default, (q, [0, SINK_FEATURES - 1, 1, 0]), sm)
    one = ctx.call(aten.new_ones.default, (k, [shape(k)[0], shape(k)[1], 1, 1]), sm)
    k0 = ctx.call(aten.constant_pad_nd.default, (one, [d, SINK_FEATURES - 1]), sm)
    k = ctx.call(aten.constant_pad_nd.default, (k, [0, SINK_FEATURES]), sm)
    k = ctx.call(aten.cat.default, ([k0, k], 2), sm)
    v = ctx.call(aten.constant_pad_nd.default, (v, [0, SINK_FEATURES + d - shape(v)[-1], 1, 0]), sm)
    return q, k, v


def pad_for_sink(ctx: RewriteContext, sm: fx.Node, x: Optional[fx.Node], Sk: int) -> Optional[fx.Node]:
    """A 4-D bias or boolean mask with the sink's column in front (0 / False: visible) and, where it has
    query rows, the dummy query's row in front."""
    if x is None:
        return None
    s = shape(x)
    if s[-1] == 1:   # broadcast over the keys: it must not reach the sink's column
        x = ctx.call(aten.expand.default, (x, [*s[:-1], Sk]), sm)
    return ctx.call(aten.constant_pad_nd.default, (x, [1, 0] + ([1, 0] if s[-2] > 1 else [])), sm)
