"""Attention written over flattened (B*H) rows, as HF BLOOM spells it (DeBERTa likewise, with ``bmm``
and its relative-position bias added before the view to 4-D)::

    S = baddbmm(alibi, q.reshape(B*H, Sq, D), k.reshape(B*H, Sk, D).transpose(1, 2), beta=b, alpha=a)
    P = softmax(S.view(B, H, Sq, Sk) [+ mask], -1)              # the softmax sees 4-D scores
    O = bmm(P.view(B*H, Sq, Sk), v.reshape(B*H, Sk, D))          # O: (B*H, Sq, D)

read back into the 4-D chain the plan describes: Q/K/V are the 4-D tensors before the reshapes, the
scale is ``a``, ``b * alibi`` (``(B*H, 1 | Sq, Sk)``) becomes a bias unflattened to ``(B, H, ...)`` at
emit (``flat_bias_rows``), and the kernel's 4-D output is flattened back to ``(B*H, Sq, D)``.
"""
from __future__ import annotations

from typing import Optional

import torch.fx as fx

from opsmath.rewrite.canonicalize import aten, is_op, last_two_transposed, shape

RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _heads_reshape(node, src_rank: int) -> Optional[fx.Node]:
    """The input ``x`` of reshape ``node`` where one of the two is (B, H, M, N) and the other
    (B*H, M, N); ``src_rank`` is x's rank (4: heads merged into rows, 3: rows split into heads)."""
    if not is_op(node, RESHAPES) or not isinstance(node.args[0], fx.Node):
        return None
    x = node.args[0]
    four, three = (shape(x), shape(node)) if src_rank == 4 else (shape(node), shape(x))
    if len(four) != 4 or len(three) != 3 or four[0] * four[1] != three[0] or four[2:] != three[1:]:
        return None
    return x


def unflattened(node) -> Optional[fx.Node]:
    """The 4-D ``x`` (B, H, S, D) if ``node`` is ``x`` reshaped to (B*H, S, D), else None."""
    return _heads_reshape(node, 4)


def rows_to_heads(node) -> Optional[fx.Node]:
    """The 3-D ``x`` (B*H, Sq, Sk) if ``node`` is ``x`` viewed as 4-D (B, H, Sq, Sk) (DeBERTa's scores
    after a (B*H)-row ``bmm`` and bias), else None."""
    return _heads_reshape(node, 3)


def flat_scores(node) -> Optional[dict]:
    """For 4-D scores ``node`` = ``view(baddbmm(bias, q3, k3^T, beta, alpha))``: the 4-D q and k (un-
    transposed), ``alpha``, the bias and ``beta``; None for anything else."""
    if not is_op(node, RESHAPES) or not is_op(node.args[0], {aten.baddbmm.default}) or len(shape(node)) != 4:
        return None
    bmm = node.args[0]
    bias, a, b = bmm.args[:3]
    beta, alpha = bmm.kwargs.get("beta", 1.0), bmm.kwargs.get("alpha", 1.0)
    kt = last_two_transposed(b)
    q, k = unflattened(a), unflattened(kt)
    if q is None or k is None or shape(q)[:2] != shape(node)[:2] or shape(k)[:2] != shape(node)[:2] \
            or not isinstance(bias, fx.Node) or not all(isinstance(c, (int, float)) for c in (beta, alpha)):
        return None
    return dict(q=q, k=k, alpha=float(alpha), bias=bias, beta=float(beta), baddbmm=bmm)


def rows_scores(node) -> Optional[dict]:
    """For 3-D scores ``node`` = ``baddbmm(bias, q3, k3^T, beta, alpha)`` over (B*H) rows that no 4-D tensor
    was flattened into (``nn.MultiheadAttention`` with a mask and its weights asked for): q3 and the un-
    transposed k3, ``alpha``, the bias and ``beta`` (``flat_scores``' fields, ``rows=True``); else None."""
    if not is_op(node, {aten.baddbmm.default}) or len(shape(node)) != 3:
        return None
    bias, a, b = node.args[:3]
    beta, alpha = node.kwargs.get("beta", 1.0), node.kwargs.get("alpha", 1.0)
    kt = last_two_transposed(b)
    if kt is None or not isinstance(bias, fx.Node) or not isinstance(a, fx.Node) \
            or not all(isinstance(c, (int, float)) for c in (beta, alpha)):
        return None
    return dict(q=a, k=kt, alpha=float(alpha), bias=bias, beta=float(beta), baddbmm=node, rows=True)


def flat_pv(p: fx.Node) -> Optional[tuple[fx.Node, fx.Node, fx.Node]]:
    """For 4-D probabilities ``p``: (the (B*H) view of p, ``bmm(view, v3)``, the 4-D v) if p is only
    flattened into that product, else None."""
    users = list(p.users)
    if len(users) != 1 or unflattened(users[0]) is not p:
        return None
    view = users[0]
    mm = list(view.users)
    if len(mm) != 1 or not is_op(mm[0], {aten.bmm.default}) or mm[0].args[0] is not view:
        return None
    v = unflattened(mm[0].args[1])
    if v is None or shape(v)[:2] != shape(p)[:2]:
        return None
    return view, mm[0], v


def flat_bias_rows(bias: fx.Node, heads: int) -> bool:
    """Whether a bias of a flattened chain has (B*H) rows to unflatten (a 1-row bias broadcasts as is)."""
    s = shape(bias)
    return len(s) == 3 and s[0] != 1 and s[0] % heads == 0
