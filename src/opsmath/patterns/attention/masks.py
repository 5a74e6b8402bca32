"""Attention masks built from index comparisons, read symbolically.

Under dynamic shapes Hugging Face builds its causal mask as a comparison of ``arange(S)`` tensors whose
length is a symbol (``le(arange(S)[None, None, None, :], arange(S)[None, None, :, None])``); it cannot be
evaluated to a constant, so the constant test (``causal_from_constant``) cannot see it is causal. Here
each index tensor is tracked exactly as *position along one axis + c* (axes counted from the last; the
other axes broadcast), and a comparison between a key index ``j`` (last axis) and a query index ``i``
(second last) becomes ``j - i <= d`` or ``j - i >= d``. The reading holds for every length, so a mask
recognized here is causal at every length. Anything else (other ops, other axes, a slice that is not
the whole range) is not recognized.

A mask combined from several conditions (Hugging Face's ``causal & sliding_window & padding``) is split
into its conjuncts (``band``): the causal and sliding-window comparisons become the kernel's ``is_causal``
and ``window`` (key blocks outside them are skipped), the rest stays a mask.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import aten

_FULL = 2 ** 62       # a slice end at least this large keeps the whole dimension
_KEEP_SHAPE = {aten.alias.default, aten.detach.default, aten.clone.default}


class _Index(NamedTuple):
    rank: int
    axis: int           # counted from the last axis (0 = last)
    offset: int
    length: object      # the arange's length: an int or a graph node (a symbolic size)


def _index(n) -> Optional[_Index]:
    """``n`` as an index tensor (``arange`` moved to one axis, plus a constant), or None."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return None
    t, a = n.target, n.args
    if t is aten.arange.default and len(a) == 1:
        return _Index(1, 0, 0, a[0])
    if t in (aten.add.Tensor, aten.sub.Tensor) and len(a) == 2 and type(a[1]) is int:
        x = _index(a[0])
        return x and x._replace(offset=x.offset + (a[1] if t is aten.add.Tensor else -a[1]))
    x = _index(a[0]) if a else None
    if x is None:
        return None
    if t is aten.unsqueeze.default:
        d = a[1] if a[1] >= 0 else a[1] + x.rank + 1
        p = x.rank - 1 - x.axis
        return x._replace(rank=x.rank + 1, axis=x.rank - (p + 1 if d <= p else p))
    if t is aten.slice.Tensor and a[2:3] in ((0,), (None,), ()) and (len(a) < 4 or a[3] is None or
                                                                       (type(a[3]) is int and a[3] >= _FULL)) \
            and (len(a) < 5 or a[4] == 1):
        return x
    if t is aten.expand.default:
        return x._replace(rank=len(a[1]))
    return x if t in _KEEP_SHAPE else None


def key_minus_query(n) -> Optional[tuple[str, int, object, object]]:
    """A boolean mask ``n`` that is ``j - i <= d`` (``("le", d, ...)``) or ``j - i >= d`` (``("ge", d,
    ...)``) for key index j on the last axis and query index i on the second last, with the lengths of
    the query and key aranges; None when ``n`` is not such a comparison."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in (aten.expand.default, *_KEEP_SHAPE):
        n = n.args[0]
    if not isinstance(n, fx.Node) or n.op != "call_function" or len(n.args) != 2:
        return None
    flip = {aten.le.Tensor: (False, 0), aten.lt.Tensor: (False, 1), aten.ge.Tensor: (True, 0),
            aten.gt.Tensor: (True, 1)}.get(n.target)
    if flip is None:
        return None
    swap, strict = flip
    small, large = (n.args[1], n.args[0]) if swap else (n.args[0], n.args[1])   # small <= large - strict
    a, b = _index(small), _index(large)
    if a is None or b is None:
        return None
    if (a.axis, b.axis) == (0, 1):    # j + ca <= i + cb - strict  <=>  j - i <= cb - ca - strict
        return "le", b.offset - a.offset - strict, b.length, a.length
    if (a.axis, b.axis) == (1, 0):    # i + ca <= j + cb - strict  <=>  j - i >= ca - cb + strict
        return "ge", a.offset - b.offset + strict, a.length, b.length
    return None


def _same_size(length, size) -> bool:
    """Whether an arange length (an int or a node holding a symbolic size) is the scores' ``size``,
    compared structurally (no guard is added)."""
    v = length.meta.get("val") if isinstance(length, fx.Node) else length
    if isinstance(v, torch.SymInt) and isinstance(size, torch.SymInt):
        return v.node.expr == size.node.expr
    return type(v) is int and type(size) is int and v == size


def is_causal_index_mask(n, removes: bool, Sq, Sk) -> bool:
    """Whether mask ``n`` is exactly top-left causal at every length: as a keep-mask (``removes`` False)
    ``j <= i``, as a remove-mask ``j > i``, over aranges of the scores' own lengths (``band`` with
    nothing but the causal conjunct)."""
    return band(n, removes, Sq, Sk, lambda x: None) == Band(True, 0, [])


_AND = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default}
_OR = {aten.__or__.Tensor, aten.bitwise_or.Tensor, aten.logical_or.default}
_CASTS = {aten.to.dtype_layout, aten.to.dtype, aten._to_copy.default}


class Band(NamedTuple):
    causal: bool        # a conjunct keeps j <= i
    window: int         # a conjunct keeps j > i - window (0: none)
    rest: list          # the other conjuncts, as they are in the graph


def _is_bool(n) -> bool:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dtype == torch.bool


def _conjuncts(n, ops: set, depth: int = 16) -> list:
    """The operands of a tree of ``ops`` (``&`` for keep-masks, ``|`` for remove-masks), looking through
    shape-keeping ops and bool-to-bool casts."""
    while isinstance(n, fx.Node) and n.op == "call_function" and (
            n.target in (aten.expand.default, *_KEEP_SHAPE) or n.target in _CASTS and _is_bool(n) and _is_bool(n.args[0])):
        n = n.args[0]
    if depth and isinstance(n, fx.Node) and n.op == "call_function" and n.target in ops and len(n.args) == 2:
        return _conjuncts(n.args[0], ops, depth - 1) + _conjuncts(n.args[1], ops, depth - 1)
    return [n]


def band(n, removes: bool, Sq, Sk, constant: Callable[[fx.Node], Optional[torch.Tensor]]) -> Optional[Band]:
    """Mask ``n`` (``removes``: True where filled, else True where kept) split into causal, sliding window
    and the rest, or None when no conjunct is causal or a window. ``constant(x)`` evaluates a conjunct
    built from constants (None otherwise): one that keeps everything is dropped, one equal to a causal
    and/or window band is read as such."""
    causal, window, rest = False, 0, []
    for x in _conjuncts(n, _OR if removes else _AND):
        rel, stays = _read(x, removes, Sq, Sk, constant)
        if stays:
            rest.append(x)
        if rel is not None and rel != (False, 0):   # (False, 0): keeps everything
            causal, window = causal or rel[0], narrower(window, rel[1])
    return Band(causal, window, rest) if causal or window else None


def _read(x, removes: bool, Sq, Sk, constant) -> tuple[Optional[tuple[bool, int]], bool]:
    """One conjunct as ((causal, window) or None, whether it stays a mask). An index comparison or a
    constant equal to a band is taken whole; a constant that only implies a band (a document mask) stays
    a mask, its flags only skipping what it removes anyway."""
    rel = key_minus_query(x)
    if rel is not None and _same_size(rel[2], Sq) and _same_size(rel[3], Sk):
        kind, d = rel[:2]
        if (kind, d) == (("ge", 1) if removes else ("le", 0)):
            return (True, 0), False
        if kind == ("le" if removes else "ge") and d <= (-1 if removes else 0):
            return (False, -d if removes else 1 - d), False   # removes j - i <= -w  /  keeps j - i >= 1 - w
        return None, True
    c = constant(x)
    if c is None or c.dtype != torch.bool:
        return None, True
    keep = ~c if removes else c
    exact = constant_band(keep, Sq, Sk)
    return (exact, False) if exact is not None else (implied_band(keep, Sq, Sk), True)


def narrower(a: int, b: int) -> int:
    """The narrower of two sliding windows (0: none)."""
    return min(a, b) if a and b else a or b


def constant_band(keep: torch.Tensor, Sq, Sk) -> Optional[tuple[bool, int]]:
    """(causal, window) when constant keep-mask ``keep`` (broadcast to (..., Sq, Sk), the same for every
    leading index) keeps exactly ``j <= i`` (if causal) and ``j > i - window`` (if window > 0); (False, 0)
    when it keeps everything; None otherwise."""
    if keep.all():
        return False, 0
    if type(Sq) is not int or Sq != Sk or keep.shape[-2:] != (Sq, Sk):
        return None
    keep = keep.reshape(-1, Sq, Sk)
    if not bool((keep == keep[:1]).all()):
        return None
    keep = keep[0]
    if keep.all():
        return False, 0
    tril = torch.ones(Sq, Sk, dtype=torch.bool).tril()
    if torch.equal(keep, tril):
        return True, 0
    w = int(keep[-1].sum())   # the last row keeps w keys in a band of width w
    if 0 < w < Sk:
        inside = ~torch.ones(Sq, Sk, dtype=torch.bool).tril(-w)
        for causal in (True, False):
            if torch.equal(keep, inside & tril if causal else inside):
                return causal, w
    return None


def implied_band(keep: torch.Tensor, Sq, Sk) -> Optional[tuple[bool, int]]:
    """(causal, window) that constant keep-mask ``keep`` implies, for every leading index: causal when it
    keeps nothing above the diagonal, window w when it keeps nothing at j <= i - w (the narrowest such w
    below Sk); None when it implies neither. A document mask ``causal & same_document`` implies causal."""
    if type(Sq) is not int or type(Sk) is not int or keep.shape[-2:] != (Sq, Sk) or not keep.any():
        return None
    kept = keep.reshape(-1, Sq, Sk).any(0)
    i, j = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
    causal = not bool((kept & (j > i)).any())
    w = int((i - j)[kept].max()) + 1
    w = w if 0 < w < Sk else 0
    return (causal, w) if causal or w else None
