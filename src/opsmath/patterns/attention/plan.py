"""The attention rewrite's plan, shared by its two spellings (a written-out chain, an SDPA call): the
operands and how the scores are modified, in the kernel's canonical form
``where(mask, fill, cap(scale * Q K^T) + bias)`` (``src/opsmath/kernels/attention/__init__.py``), and the checks every plan passes
before it is emitted (``line_up``, ``finish_plan``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import causal_from_constant, constant_value, dtype, repeat_kv_source, shape, val

from opsmath.patterns.attention.flat import flat_bias_rows
from opsmath.patterns.attention.masks import Band, band, constant_band, narrower

# a mask fill or additive bias at or below this removes a position exactly (exp underflows to 0 in fp32)
REMOVES = -1e4
# the dtypes torch.autocast computes in: an op whose output has one of them beside fp32 operands was cast
AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class Plan:
    qk: fx.Node
    pv: fx.Node
    q: fx.Node
    k: fx.Node                        # (..., Sk, D): already un-transposed
    k_needs_transpose: bool
    v: fx.Node
    rep: int = 1                      # GQA: query heads per kv head (k, v are kv-head tensors)
    scale: float = 1.0
    softcap: float = 0.0              # c in c * tanh(scale * QK^T / c), before biases and masks; 0: none
    biases: list = field(default_factory=list)   # [node, multiplier]
    masks: list = field(default_factory=list)    # (node, negate)
    fill: float = float("-inf")
    causal: bool = False
    window: int = 0                   # sliding window: key j is seen by query i only if j > i - window; 0: none
    window_in_mask: int = 0           # a window left inside a finite-fill mask (not skipped: docs/design.md)
    dropout_p: float = 0.0
    nodes: list = field(default_factory=list)    # chain nodes, in graph order
    scores: tuple = ()                # the scores' shape (..., Sq, Sk)
    flat_rows: bool = False           # scores from (B*H)-row operands (flat.py): biases unflattened
    flat_out: bool = False            # P V over (B*H) rows: the 4-D output is flattened back
    sink: Optional[fx.Node] = None    # attention sinks: a logit per head in the softmax (sinks.py)
    q_scales: list = field(default_factory=list)   # (t, aten.mul/div.Tensor): tensors (..., 1) applied to score rows
    autocast: bool = False            # an SDPA call whose fp32 operands autocast cast (float biases too)


def bias_shape(plan: Plan, b: fx.Node) -> tuple:
    """A bias's shape as the 4-D scores see it: (B*H)-row biases of a flattened chain as (B, H, ...); a
    5-D per-window bias (1, W|1, H|1, N, N) of Swin's split scores (``chain._windows_merged``)
    as (A*W|1, H|1, N, N)."""
    s = shape(b)
    if plan.flat_rows and flat_bias_rows(b, plan.scores[1]):
        return (s[0] // plan.scores[1], plan.scores[1]) + s[1:]
    if len(s) == 5:
        return (plan.scores[0] if s[1] > 1 else 1,) + s[2:]
    return s


def line_up(plan: Plan) -> Optional[str]:
    """Check (and complete) a plan's operands against its scores' shape: GQA's ``repeat_kv`` undone
    into ``plan.rep`` (unless already set), then shapes, dtypes and devices; a reason to decline or None."""
    lead, Sk, nd = plan.scores[:-2], plan.scores[-1], len(plan.scores)
    q, k, v = plan.q, plan.k, plan.v
    D = shape(q)[-1]
    kshape = shape(k)[:-2] + (shape(k)[-1], shape(k)[-2]) if plan.k_needs_transpose else shape(k)
    if nd == 4 and plan.rep == 1 and not plan.k_needs_transpose:   # K/V repeated to every query head
        kv = repeat_kv_source(k, lead[1]), repeat_kv_source(v, lead[1])
        if kv[0] is not None and kv[1] is not None and kv[0][1] == kv[1][1] > 1:
            (plan.k, plan.rep), (plan.v, _) = kv   # read per kv head: the kernel maps head h to h // rep
            kshape, v = shape(plan.k), plan.v
    if nd == 4 and plan.rep > 1:
        if kshape[0] != lead[0] or kshape[1] * plan.rep != lead[1] or shape(v)[:-2] != kshape[:-2]:
            return "K/V heads do not divide the query heads"
    elif nd == 4 and kshape[:-2] != lead:
        return f"K/V batch dims {kshape[:-2]} differ from the scores' {lead} in a way not understood"
    elif nd == 4 and shape(v)[:-2] != lead:
        return "V batch dims differ from the scores' (K and V repeated differently?)"
    if shape(q)[:-2] != lead or kshape[-2:] != (Sk, D) or shape(plan.v)[-2] != Sk:
        return "Q/K/V shapes do not line up (broadcasting matmul)"
    if shape(q)[-2] != plan.scores[-2]:   # the scores widened by a bias or mask: the kernel takes Q's rows
        return f"Q's {shape(q)[-2]} rows broadcast to the scores' {plan.scores[-2]} by a bias or mask"
    if shape(plan.v)[-1] != D and not all(isinstance(x, int) for x in (shape(plan.v)[-1], D)):
        return f"V head dim {shape(plan.v)[-1]} differs from Q/K head dim {D}, symbolic"
    if dtype(plan.qk) != dtype(plan.pv) or dtype(plan.qk) not in (torch.float16, torch.bfloat16, torch.float32,
                                                                  torch.float64):
        return f"mixed or unsupported dtypes: QK^T in {dtype(plan.qk)}, PV in {dtype(plan.pv)}"
    if plan.qk is plan.pv and (why := _sdpa_dtypes(plan)) is not None:
        return why
    devs = {getattr(val(n), "device", None) for n in (q, plan.k, plan.v, plan.qk)}
    if len(devs) != 1:
        return f"operands on different devices {devs}"
    return None


def _sdpa_dtypes(plan: Plan) -> Optional[str]:
    """An SDPA call's operands in its output's dtype, or cast to it by autocast.

    SDPA itself requires one dtype for Q, K and V; a traced call whose operands differ ran under
    ``torch.autocast``, which casts every fp32 operand (a float ``attn_mask`` too) to the autocast dtype
    and leaves fp64 alone. HF's RoPE is the common case: q and k come out fp32 (fp32 cos/sin) beside a
    bf16 v. The fused op sees its inputs raw, so ``_operands`` and ``_bias`` make those casts explicit.
    """
    out = dtype(plan.qk)
    if all(dtype(x) == out for x in (plan.q, plan.k, plan.v)):
        return None
    if out not in AUTOCAST_DTYPES or any(dtype(x) not in (torch.float32, out) for x in (plan.q, plan.k, plan.v)):
        return f"Q, K and V in different dtypes ({', '.join(str(dtype(x)) for x in (plan.q, plan.k, plan.v))})"
    plan.autocast = True
    return None


def finish_plan(ctx, plan: Plan) -> Union[str, Plan]:
    """Biases must broadcast to the scores; constant causal masks and biases become ``is_causal``."""
    for what, x in [("bias", b) for b, _ in plan.biases] + [("mask", m) for m, _ in plan.masks] + [
            ("row scale", t) for t, _ in plan.q_scales]:
        xs = bias_shape(plan, x) if what == "bias" else shape(x)
        try:
            ok = torch.broadcast_shapes(xs, plan.scores) == plan.scores
        except RuntimeError:
            ok = False
        if not ok:
            return f"{what} of shape {xs} does not broadcast to the scores {plan.scores}"
    kept = (list(plan.biases), list(plan.masks), plan.fill, plan.causal)
    _detect_causal(ctx, plan, *plan.scores[-2:])
    if plan.sink is not None and plan.window:   # a skipped window would hide the sink: the mask stays as written
        plan.biases, plan.masks, plan.fill, plan.causal = kept
        plan.window = plan.window_in_mask = 0
    return plan


def _detect_causal(ctx, plan: Plan, Sq: int, Sk: int) -> None:
    """Masks/biases equal to the ``j > i`` pattern become ``is_causal`` (block skipping): constant ones,
    and masks built from index comparisons of symbolic length (``masks.py``), alone or combined
    with a sliding window (``plan.window``) and other conditions (which stay a mask). A constant bias of
    zeros is dropped (``x + 0`` is ``x``): the kernel, or a vendor's, runs without one."""
    def const(x):
        return constant_value(ctx.gm, x, ctx.constants)
    for mask in list(plan.masks):
        m, negate = mask
        c = const(m)
        if c is not None:
            split = _constant_split(c if negate else ~c, Sq, Sk) if plan.fill <= REMOVES else None
            if split:
                plan.masks.remove(mask)
                _take_band(plan, split)
            continue
        split = band(m, not negate, Sq, Sk, const)
        if split is not None and plan.fill <= REMOVES and (not split.rest or plan.fill == float("-inf")):
            _take_band(plan, split)
            if not split.rest:   # every row keeps its diagonal: the mask's fill never matters
                plan.masks.remove(mask)
        elif split is not None and split.window:
            plan.window_in_mask = split.window
    for bias in list(plan.biases):
        c = const(bias[0])
        am = additive_mask(ctx, bias[0]) if c is None and bias[1] > 0 else None
        split = am and band(am[0], not am[1], Sq, Sk, const)
        if split and not split.rest:
            plan.biases.remove(bias)   # where(causal [& window], 0, min), symbolic length (HF's eager mask)
            _take_band(plan, split)
        elif split and split.window:
            plan.window_in_mask = split.window
        if c is None or not c.is_floating_point():
            continue
        if bool((c * bias[1] == 0).all()) and constant_value(ctx.gm, bias[0], {}) is not None:
            plan.biases.remove(bias)   # zeros added, made in the graph (T5's cross-attention): no bias (a buffer
            continue                   # of zeros stays: ``.data`` writes change it unseen by the guard)
        removed = (c * bias[1]) <= REMOVES
        kept_zero = bool(((c == 0) | removed).all())
        split = _constant_split(~removed, Sq, Sk) if kept_zero else None
        if split:
            plan.biases.remove(bias)
            _take_band(plan, split)
    if not plan.masks:
        plan.fill = float("-inf")


def _constant_split(keep, Sq, Sk) -> Optional[Band]:
    """A constant keep-mask that is exactly causal and/or a sliding window, as a ``Band``; else None."""
    if causal_from_constant(~keep, Sq, Sk):
        return Band(True, 0, [])
    split = constant_band(keep, Sq, Sk)
    return Band(*split, []) if split and split != (False, 0) else None


def _take_band(plan: Plan, split) -> None:
    """Causal and window flags from a mask's conjuncts: the kernels skip what they remove."""
    plan.causal, plan.window = plan.causal or split.causal, narrower(plan.window, split.window)


def fill_value(ctx, x) -> Optional[float]:
    """A mask's fill as a float: a Python number or a constant 0-d/1-element tensor."""
    if isinstance(x, (int, float)):
        return float(x)
    c = constant_value(ctx.gm, x, ctx.constants)
    if c is not None and c.numel() == 1:
        return float(c.reshape(()))
    return None


# Below this an additive fill swallows every score: s + f rounds to f in fp32 and bf16 for |s| < 1e29.
SWALLOWS = -1e30


def additive_mask(ctx, x) -> Optional[tuple]:
    """``(cond, masked_where_false)`` for ``x = where(cond, 0, f)`` or ``where(cond, f, 0)`` with
    ``f <= SWALLOWS``; None otherwise. Such a bias removes positions as a mask does; it is turned into
    one only where it is causal (every row keeps its diagonal): for a fully masked row the additive
    spelling passes gradients to Q and K (eager's autograd sees ``s + f``), a mask does not."""
    if not isinstance(x, fx.Node) or x.target not in (torch.ops.aten.where.self, torch.ops.aten.where.ScalarOther,
                                                     torch.ops.aten.where.ScalarSelf, torch.ops.aten.where.Scalar):
        return None
    cond, a, b = x.args[:3]
    fa, fb = fill_value(ctx, a), fill_value(ctx, b)
    if fa == 0.0 and fb is not None and fb <= SWALLOWS:
        return cond, True
    if fb == 0.0 and fa is not None and fa <= SWALLOWS:
        return cond, False
    return None
