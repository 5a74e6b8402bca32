"""Dropout-add-norm: ``norm(residual + dropout(y))`` to ``opsmath::dropout_add_norm``.

Three norm spellings are anchors, each fed by a residual ``add`` whose operands have the output's shape:

* ``aten.layer_norm`` (``nn.LayerNorm``, ``F.layer_norm``), normalized over the last dim;
* ``aten.rms_norm`` (``nn.RMSNorm``, ``F.rms_norm``);
* hand-written RMSNorm as LLaMA/T5/Mistral write it::

      hf = h.to(float32);  r = rsqrt(mean(hf**2 | hf*hf, -1, keepdim=True) + eps)
      out = weight * (hf * r).to(h.dtype)          (casts and the weight optional, either operand order)

* RMSNorm through ``F.normalize`` (x-transformers' ``RMSNorm`` / ``SimpleRMSNorm``)::

      out = F.normalize(h, dim=-1) * sqrt(D) [* weight]  =  h sqrt(D) / max(||h||, e)

  read as ``rms_norm`` with eps' = e^2 / D: ``h / sqrt(||h||^2 / D + e^2 / D) = h sqrt(D) / sqrt(||h||^2 + e^2)``.
  The two differ by the factor ``sqrt(||h||^2 + e^2) / max(||h||, e)``, 1 within fp32 rounding unless
  ``||h|| < 1e3 e`` (e = 1e-12 by default); an all-zero row gives 0 either way. Another scale than sqrt(D)
  is a different function: declined with that reason.

Dropout is optional (either add operand may be a dropout with no other user); pre-LN and post-LN
orders are the same graph shape. When later code also reads the residual sum ``h`` (pre-LN
transformers keep it as the residual stream), those uses are rewired to the op's ``h`` output.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import aten, dropout_info, dtype, is_cast, is_op, shape, strip_casts, val
from opsmath.kernels._common import new_seed
from opsmath.rewrite.match import RewriteContext, node_line
from opsmath.rewrite.rules import Rule, register_rule

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class _Plan:
    h: fx.Node                       # the residual add
    x: fx.Node                       # the (dropped-out) branch
    residual: fx.Node
    dropout_p: float
    weight: Optional[fx.Node]
    bias: Optional[fx.Node]
    eps: float
    is_rms: bool
    out: fx.Node                     # the norm's final node
    internal: list = field(default_factory=list)   # nodes the op replaces (besides h)
    h_casts: list = field(default_factory=list)    # casts of h inside the pattern that others may read


def _residual_add(h) -> Optional[tuple[fx.Node, fx.Node, float, Optional[fx.Node]]]:
    """(x, residual, p, dropout node) if ``h`` is ``residual + dropout(x)`` (dropout optional) with no
    broadcasting."""
    if not is_op(h, {aten.add.Tensor}) or h.kwargs.get("alpha", 1) != 1 or len(h.args) != 2:
        return None
    a, b = h.args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or not (shape(a) == shape(b) == shape(h)):
        return None
    if dtype(h) not in _FLOATS or dtype(a) not in _FLOATS or dtype(b) not in _FLOATS:
        return None
    for x, r in ((a, b), (b, a)):
        d = dropout_info(x)
        if d is not None and len(x.users) == 1:
            return d[0], r, d[1], x
    return a, b, 0.0, None


class DropoutAddNormRule(Rule):
    name = "dropout_add_norm"
    anchors = (aten.layer_norm.default, aten.rms_norm.default, aten.rsqrt.default, aten.linalg_vector_norm.default)

    def match(self, ctx: RewriteContext, n: fx.Node) -> Union[None, str, _Plan]:
        if is_op(n, {aten.linalg_vector_norm.default}):
            plan = _normalize_rms(n)
        else:
            plan = self._handwritten_rms(n) if is_op(n, {aten.rsqrt.default}) else self._library_norm(n)
        return plan if plan is None or isinstance(plan, str) else self._check_order(ctx, plan)

    def anchor_for(self, n: fx.Node, plan) -> fx.Node:
        return n if isinstance(plan, str) else plan.out    # a hand-written RMS norm: its last node

    def emit(self, ctx: RewriteContext, n: fx.Node, plan: _Plan) -> None:
        self._emit(ctx, plan)

    # ------------------------------------------------------------------------------------------
    def _library_norm(self, n: fx.Node) -> Union[None, str, _Plan]:
        a = list(n.args) + [None] * 6
        inp, nshape, weight, bias = a[0], a[1], a[2], a[3]
        is_rms = n.target is aten.rms_norm.default
        if is_rms:
            eps, bias = a[3], None
            if eps is None:
                eps = torch.finfo(dtype(inp)).eps if dtype(inp) in _FLOATS else None
        else:
            eps = a[4] if a[4] is not None else n.kwargs.get("eps", 1e-5)
        h = strip_casts(inp)    # F.rms_norm(h.float(), ...): the residual sum read through its upcast
        res = _residual_add(h)
        if res is None:
            return None
        if len(nshape) != 1 or nshape[0] != shape(inp)[-1]:
            return "normalizes over more than the last dim"
        if eps is None or not isinstance(eps, (int, float)):
            return "eps is not a constant"
        casts = _exact_casts(h, inp)
        if isinstance(casts, str):
            return casts
        x, r, p, drop = res
        return _Plan(h=h, x=x, residual=r, dropout_p=p, weight=weight, bias=bias, eps=float(eps),
                     is_rms=is_rms, out=n, internal=[d for d in (drop,) if d is not None] + [n], h_casts=casts)

    def _handwritten_rms(self, r: fx.Node) -> Union[None, str, _Plan]:
        """``h * rsqrt(mean(h**2, -1, keepdim=True) + eps) [* w]`` anchored at the ``rsqrt`` ``r``."""
        core = _rms_statistic(r)
        if core is None:
            return None
        sq, var, add_eps, eps, hf = core
        tail = _rms_scaling(r, hf)
        if tail is None:
            return None
        normed, scaled, weight, scale_chain, cur = tail
        h, h_casts = strip_casts(hf), _casts_of_h(hf, scaled)
        res = _residual_add(h)
        if res is None:
            return None
        x, resid, p, drop = res
        return _Plan(h=h, x=x, residual=resid, dropout_p=p, weight=weight, bias=None, eps=float(eps),
                     is_rms=True, out=cur, internal=[d for d in (drop,) if d is not None]
                     + [sq, var, add_eps, r, normed, *scale_chain], h_casts=h_casts)

    # ------------------------------------------------------------------------------------------
    def _check_order(self, ctx, plan: _Plan) -> Union[str, _Plan]:
        """The op is inserted right after the last of its inputs; every outside reader of h must
        come after that point."""
        pos = {n: i for i, n in enumerate(ctx.graph.nodes)}
        ins = max(pos[n] for n in (plan.h, plan.weight, plan.bias) if n is not None)
        inside = set(plan.internal) | set(plan.h_casts)
        for src in [plan.h, *plan.h_casts]:
            for u in src.users:
                if u not in inside and pos[u] <= ins:
                    return f"{u.name} reads the residual sum before the norm's weights are available"
        devs = {getattr(val(n), "device", None) for n in (plan.x, plan.residual, plan.weight, plan.bias)
                if n is not None}
        if len(devs) != 1:
            return f"operands on different devices {devs}"
        plan.anchor = max((n for n in (plan.h, plan.weight, plan.bias) if n is not None), key=pos.__getitem__)
        return plan

    def _emit(self, ctx: RewriteContext, plan: _Plan) -> None:
        before = [node_line(n) for n in [plan.h, *plan.h_casts, *plan.internal]]
        y, h_out = _insert_op(ctx, plan)
        inside = set(plan.internal) | set(plan.h_casts)
        plan.out.replace_all_uses_with(y)
        plan.h.replace_all_uses_with(h_out, delete_user_cb=lambda u: u not in inside)
        for c in plan.h_casts:    # a cast of h read outside the pattern reads h_out's cast instead
            if any(u not in inside for u in c.users):
                with ctx.graph.inserting_after(h_out):
                    hc = ctx.call(aten.to.dtype, (h_out, dtype(c)), c)
                c.replace_all_uses_with(hc, delete_user_cb=lambda u: u not in inside)
        replaced = [plan.h, *plan.h_casts, *plan.internal]
        ctx.erase_dead([plan.out, *reversed(plan.internal)])
        kind = "rms" if plan.is_rms else "layer"
        desc = f"opsmath::dropout_add_norm({kind}, eps={plan.eps:g}" + \
            (f", dropout={plan.dropout_p:g}" if plan.dropout_p else "") + \
            (", residual out" if h_out.users else "") + ")"
        ctx.replaced(self.name, plan.out, replaced, desc, before, norm=kind, dropout_p=plan.dropout_p,
                     width=shape(plan.h)[-1], residual_out=bool(h_out.users),
                     dtype=str(dtype(plan.h)).replace("torch.", ""))


def _insert_op(ctx: RewriteContext, plan: _Plan) -> tuple[fx.Node, fx.Node]:
    """``opsmath::dropout_add_norm`` and its two results (normed y, residual sum h) inserted after the
    plan's anchor, operands cast to h's dtype (``inserting_after`` places each node after the last)."""
    hd = dtype(plan.h)
    nodes = []

    def call(target, args, kwargs=None):
        with ctx.graph.inserting_after(nodes[-1] if nodes else plan.anchor):
            nodes.append(ctx.call(target, args, plan.out, kwargs))
        return nodes[-1]

    x = plan.x if dtype(plan.x) == hd else call(aten.to.dtype, (plan.x, hd))
    r = plan.residual if dtype(plan.residual) == hd else call(aten.to.dtype, (plan.residual, hd))
    seed = call(new_seed, (x,)) if plan.dropout_p > 0 else None   # no dropout: the op takes no seed
    res = call(torch.ops.opsmath.dropout_add_norm.default,
               (x, r, plan.weight, plan.bias, plan.is_rms, plan.eps, plan.dropout_p, seed, dtype(plan.out)))
    return call(operator.getitem, (res, 0)), call(operator.getitem, (res, 1))


def _normalize_rms(n: fx.Node) -> Union[None, str, _Plan]:
    """``F.normalize(h, dim=-1) * sqrt(D) [* w]`` anchored at its ``linalg_vector_norm`` ``n`` (module
    docstring: eps' = e^2 / D), h a residual sum read through exact casts; None if it is not this spelling."""
    a = list(n.args) + [None] * 4
    hf, nd = a[0], len(shape(a[0]))
    dims = a[2] if isinstance(a[2], (list, tuple)) else None
    if a[1] not in (2, 2.0) or not dims or [d % nd for d in dims] != [nd - 1] or not a[3] or len(n.users) != 1:
        return None
    clamp = next(iter(n.users))
    if not is_op(clamp, {aten.clamp_min.default}) or not isinstance(clamp.args[1], (int, float)) \
            or len(clamp.users) != 1:
        return None
    grow = next(iter(clamp.users))
    div = next(iter(grow.users)) if is_op(grow, {aten.expand_as.default, aten.expand.default}) \
        and len(grow.users) == 1 else grow
    if not is_op(div, {aten.div.Tensor}) or div.args[1] is not (grow if div is not grow else clamp) \
            or div.args[0] is not hf:
        return None
    width = shape(hf)[-1]
    chain, cur, weight, scale = [], div, None, None
    while len(cur.users) == 1:
        u = next(iter(cur.users))
        other = u.args[1] if u.args[0] is cur else u.args[0]
        if is_op(u, {aten.mul.Tensor}) and isinstance(other, (int, float)) and scale is None:
            scale = float(other)
        elif is_op(u, {aten.mul.Tensor}) and isinstance(other, fx.Node) and shape(other) == (width,) \
                and weight is None:
            weight = other
        elif not is_cast(u):
            break
        chain.append(u)
        cur = u
    h = strip_casts(hf)
    res = _residual_add(h)
    if res is None:
        return None
    if scale is None or abs(scale - width ** 0.5) > 1e-6 * width ** 0.5:
        return f"F.normalize scaled by {scale}, not sqrt({width}): not an RMS norm"
    casts = _exact_casts(h, hf)
    if isinstance(casts, str):
        return casts
    x, resid, p, drop = res
    internal = [d for d in (drop,) if d is not None] + [n, clamp] + ([grow] if grow is not div else []) + [div]
    return _Plan(h=h, x=x, residual=resid, dropout_p=p, weight=weight, bias=None, eps=float(clamp.args[1]) ** 2 / width,
                 is_rms=True, out=cur, internal=internal + chain, h_casts=casts)


def _rms_statistic(r: fx.Node):
    """(square, mean, add-eps, eps, h) if ``r = rsqrt(mean(h*h or h**2, -1, keepdim=True) + eps)``,
    each intermediate read once, else None."""
    add_eps = r.args[0]
    if not (is_op(add_eps, {aten.add.Tensor}) and len(add_eps.users) == 1):
        return None
    var, eps = add_eps.args[0], add_eps.args[1]
    if isinstance(var, (int, float)):
        var, eps = eps, var
    if not (is_op(var, {aten.mean.dim}) and isinstance(eps, (int, float)) and len(var.users) == 1):
        return None
    dims = var.args[1] if len(var.args) > 1 else var.kwargs.get("dim")
    keep = var.args[2] if len(var.args) > 2 else var.kwargs.get("keepdim", False)
    sq = var.args[0]
    nd = len(shape(sq))
    if not keep or dims is None or [d % nd for d in dims] != [nd - 1] or len(sq.users) != 1:
        return None
    if is_op(sq, {aten.pow.Tensor_Scalar}) and sq.args[1] == 2:
        return sq, var, add_eps, eps, sq.args[0]
    if is_op(sq, {aten.mul.Tensor}) and sq.args[0] is sq.args[1]:
        return sq, var, add_eps, eps, sq.args[0]
    return None


def _rms_scaling(r: fx.Node, hf: fx.Node):
    """(normed, scaled h, weight or None, casts and weight product after normed, result) for
    ``normed = scaled * r`` followed by casts and at most one product with a [D] weight, else None."""
    users = list(r.users)
    if len(users) != 1 or not is_op(users[0], {aten.mul.Tensor}):
        return None
    normed = users[0]
    scaled = normed.args[0] if normed.args[1] is r else normed.args[1]
    if not isinstance(scaled, fx.Node) or strip_casts(scaled) is not strip_casts(hf):
        return None  # T5 scales h itself, LLaMA its fp32 cast: either is this pattern
    chain, cur, weight = [], normed, None
    while len(cur.users) == 1:
        u = next(iter(cur.users))
        if is_cast(u):
            chain.append(u)
            cur = u
            continue
        if is_op(u, {aten.mul.Tensor}) and weight is None:
            other = u.args[1] if u.args[0] is cur else u.args[0]
            if isinstance(other, fx.Node) and shape(other) == (shape(hf)[-1],):
                weight = other
                chain.append(u)
                cur = u
                continue
        break
    return normed, scaled, weight, chain, cur


def _exact_casts(h: fx.Node, read: fx.Node) -> Union[list, str]:
    """The casts from the residual sum ``h`` to the norm's input ``read`` (part of the pattern), or the
    decline reason when one of them rounds h (the fused op reads h itself)."""
    casts = _casts_of_h(read, read)
    if casts and not _widens(h, read):
        return f"the residual sum is rounded to {dtype(read)} before the norm (the fused op reads it in {dtype(h)})"
    return casts


def _widens(h: fx.Node, cast: fx.Node) -> bool:
    """Whether every cast from ``h`` to ``cast`` keeps its values exactly (each at least as wide, floats).
    The norm computes in fp32 whatever it reads, so it reads h itself and the upcast is free."""
    node, widest = cast, dtype(cast)
    while node is not h:
        if dtype(node) not in _FLOATS or torch.finfo(dtype(node)).bits < torch.finfo(dtype(node.args[0])).bits:
            return False
        node = node.args[0]
    return widest in _FLOATS


def _casts_of_h(hf: fx.Node, scaled: fx.Node) -> list:
    """The casts between h and the two places it is read (squared, scaled): part of the pattern."""
    h_casts = []
    for start in (hf, scaled):
        while is_cast(start):
            if start not in h_casts:
                h_casts.append(start)
            start = start.args[0]
    return h_casts


PATTERN = register_rule(DropoutAddNormRule())
