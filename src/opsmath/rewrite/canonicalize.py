"""Canonical views of pre-dispatch ATen graphs: the vocabulary pattern matchers share.

Pre-dispatch ATen already merges most spellings (``@``/``matmul``, method/function). What remains is
handled here, once, so that every pattern sees the same thing:

* casts (``to``, ``_to_copy``, ``type_as``) are recognized and can be looked through;
* scalar scales: ``x * c``, ``x / c``, ``c * x`` become one multiplier;
* transposes of the last two dims in any spelling (``transpose(-2, -1)``, ``(2, 3)``, ``permute``);
* batched matrix products in any spelling: ``matmul``, ``bmm``, and ``einsum`` equations that are
  one (``"bhqd,bhkd->bhqk"`` is ``q @ k^T``), read by ``as_matmul``;
* ``scaled_dot_product_attention``'s arguments by name (``sdpa_args``), and GQA's ``repeat_kv`` (HF's
  unsqueeze/expand/reshape, ``repeat_interleave``, a single kv head's ``expand``) undone;
* constant subgraphs (tensor factories, module buffers) can be evaluated to real values, which is how
  ``masked_fill(tril[:T, :T] == 0, -inf)`` and HF's arange-built additive masks are recognized as causal.
"""
from __future__ import annotations

import numbers
from types import SimpleNamespace
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from opsmath.rewrite.constants import constant_value  # noqa: F401  (re-exported: the matchers' vocabulary)

aten = torch.ops.aten

CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default, aten.to.device}
MATMULS = {aten.matmul.default, aten.bmm.default}
SOFTMAXES = {aten.softmax.int, aten._softmax.default}
DROPOUTS = {aten.dropout.default}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default}


def is_op(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def val(node):
    """The fake tensor (or value) recorded for ``node`` at capture."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def shape(node) -> tuple:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def dtype(node) -> Optional[torch.dtype]:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def size_hint(s) -> int:
    """An int size, or a symbolic one's value at capture (its shape env's hint), without a guard. A
    data-dependent size (``torch.where``'s row count) has no value at capture: its largest possible
    value is taken (0 if unbounded), so byte counts built on it are upper estimates."""
    if isinstance(s, int):
        return s
    h = getattr(s.node, "hint", None)
    if h is not None:
        return int(h)
    env = s.node.shape_env
    if not free_unbacked_symbols(s):
        return int(env.size_hint(s.node.expr))
    upper = env.bound_sympy(s.node.expr).upper
    return int(upper) if upper.is_finite else 0


def hinted(t: torch.Tensor) -> SimpleNamespace:
    """``t``'s shape (symbolic sizes replaced by the values seen at capture, no guard added), dtype and
    device: what a tuner measures, in a graph that serves every value of a dynamic size."""
    return SimpleNamespace(shape=tuple(size_hint(s) for s in t.shape), dtype=t.dtype, device=t.device)


# GEMMs whose bf16 result from an fp32 operand only autocast makes
_AUTOCAST_GEMMS = MATMULS | {aten.linear.default, aten.mm.default, aten.addmm.default}


def _autocast_off_at(graph: fx.Graph, node: fx.Node) -> bool:
    """Whether ``node`` lies inside a region of ``graph`` that turns autocast off
    (``with torch.autocast(..., enabled=False)`` in the model's code)."""
    regions = []
    for n in graph.nodes:
        if n is node:
            return not all(regions)
        if n.target is torch.amp.autocast_mode._enter_autocast:
            regions.append(bool(n.args[2]) if len(n.args) > 2 else True)
        elif n.target is torch.amp.autocast_mode._exit_autocast and regions:
            regions.pop()
    return False


def under_bf16_autocast(graph: fx.Graph, node: Optional[fx.Node] = None) -> bool:
    """Whether ``graph`` (at ``node``, if given) computes under bf16 autocast: not inside a region turning it
    off; then it is being captured (rewrites run inside its capture, and dynamo guards a compiled graph on
    the autocast state) under bf16 autocast for its tensors' device and holds no autocast region of its own;
    else some GEMM of an fp32 operand gives a bf16 result (only autocast makes one). The capture's state
    catches a graph piece with no such GEMM (an MoE layer's experts split from the rest)."""
    if node is not None and _autocast_off_at(graph, node):
        return False
    enters = graph.find_nodes(op="call_function", target=torch.amp.autocast_mode._enter_autocast)
    devices = {v.device.type for n in graph.find_nodes(op="placeholder")
               if isinstance(v := n.meta.get("val"), torch.Tensor)}
    if not enters and any(torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d) == torch.bfloat16
                          for d in devices & {"cuda", "cpu"}):
        return True
    return any(n.op == "call_function" and n.target in _AUTOCAST_GEMMS and dtype(n) == torch.bfloat16
               and any(isinstance(a, fx.Node) and dtype(a) == torch.float32 for a in n.args[:3])
               for n in graph.nodes)


def is_cast(node) -> bool:
    """A dtype conversion that keeps shape and device (``to(dtype)``, ``_to_copy``, ``type_as``)."""
    if not is_op(node, CASTS):
        return False
    src = node.args[0]
    return isinstance(src, fx.Node) and shape(src) == shape(node) and \
        getattr(val(src), "device", None) == getattr(val(node), "device", None)


SAME_SHAPE_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default)


def is_noop_view(node) -> bool:
    """A view or reshape to the shape its input already has (HF Falcon's ``scores.view(B, H, Sq, Sk)`` of
    a 4-D product): the identity on values."""
    if not is_op(node, SAME_SHAPE_VIEWS):
        return False
    src = node.args[0]
    return isinstance(val(src), torch.Tensor) and isinstance(val(node), torch.Tensor) and shape(src) == shape(node)


def passes_through(node) -> bool:
    """Same values in another dtype or under another name: a cast or a no-op view."""
    return is_cast(node) or is_noop_view(node)


def strip_casts(node):
    while is_cast(node):
        node = node.args[0]
    return node


def dropout_info(node) -> Optional[tuple[fx.Node, float]]:
    """(input, p) if ``node`` is dropout; p is 0.0 when it is disabled (eval, or p == 0)."""
    if not is_op(node, DROPOUTS):
        return None
    p = float(node.args[1]) if len(node.args) > 1 else float(node.kwargs.get("p", 0.5))
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return node.args[0], (p if train else 0.0)


def private_temporary(node) -> bool:
    """``node`` is a fresh tensor (an op's result that aliases none of its inputs) with one user, so an
    in-place op of that user is observed by no one else."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and len(node.users) == 1):
        return False
    schema = getattr(node.target, "_schema", None)
    return schema is not None and len(schema.returns) == 1 and schema.returns[0].alias_info is None


def _factor(x, constant=None) -> Optional[float]:
    """``x`` as a scale factor: a Python number, or (given ``constant``, a node -> tensor-or-None
    evaluator) a one-element nonzero floating constant tensor; else None."""
    if isinstance(x, numbers.Number):
        return float(x)
    if constant is None or not isinstance(x, fx.Node):
        return None
    v = constant(x)
    if v is None or v.numel() != 1 or not v.is_floating_point() or float(v) == 0:
        return None
    return float(v)


def scalar_scale(node, constant=None) -> Optional[tuple[fx.Node, float]]:
    """(input, c) if ``node`` multiplies a tensor by a Python number c (``x*c``, ``c*x``, ``x/c``, and
    their in-place forms on an intermediate nothing else reads). With ``constant`` (see ``_factor``)
    ``x * t`` and ``x / t`` by a one-element constant tensor t count too (DeBERTa's ``k / sqrt(tensor(d))``)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.kwargs:
        return None
    a = node.args
    if node.target in (aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar):
        # in place on an intermediate only it uses (Falcon's ``scores *= inv_norm``): the same value
        if not private_temporary(a[0]):
            return None
        node, constant = SimpleNamespace(target=getattr(aten, node.target._opname.rstrip("_")).Tensor, args=a), None
    if node.target in (aten.mul.Tensor, aten.mul.Scalar):
        if (f := _factor(a[1], constant)) is not None and isinstance(a[0], fx.Node):
            return a[0], f
        if isinstance(a[0], numbers.Number) and isinstance(a[1], fx.Node):
            return a[1], float(a[0])
    if node.target in (aten.div.Tensor, aten.div.Scalar) and (f := _factor(a[1], constant)) is not None and f != 0:
        return a[0], 1.0 / f
    return None


def strip_scales(node, constant=None) -> tuple[fx.Node, float]:
    """Look through scalar multiplications (``scalar_scale``, with ``constant`` passed on): returns
    (base, product of the scales)."""
    c = 1.0
    while (s := scalar_scale(node, constant)) is not None:
        node, k = s
        c *= k
    return node, c


def last_two_transposed(node) -> Optional[fx.Node]:
    """The input of ``node`` if ``node`` swaps exactly the last two dims of it, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    nd = len(shape(node))
    if node.target is aten.transpose.int:
        d0, d1 = (d % nd for d in node.args[1:3])
        return node.args[0] if {d0, d1} == {nd - 2, nd - 1} else None
    if node.target is aten.permute.default:
        perm = [d % nd for d in node.args[1]]
        want = list(range(nd - 2)) + [nd - 1, nd - 2]
        return node.args[0] if perm == want else None
    if node.target in (aten.t.default, aten.numpy_T.default) and nd == 2:
        return node.args[0]
    return None


def as_matmul(node) -> Optional[tuple[fx.Node, fx.Node, bool]]:
    """``(a, b, b_transposed)`` if ``node`` is the batched product ``a @ b`` (``b_transposed``: ``a @
    b^T``, b given as (..., N, K)) over the last two dims with equal leading dims: ``matmul``/``bmm``,
    or an ``einsum`` whose equation is one (``"xyik,xyjk->xyij"``, ``"xyik,xykj->xyij"``; no
    ellipsis, repeated or summed batch letters)."""
    if is_op(node, MATMULS):
        return node.args[0], node.args[1], False
    if not is_op(node, {aten.einsum.default}) or len(node.args[1]) != 2:
        return None
    eq = node.args[0].replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    (lhs, out), (a, b) = eq.split("->"), node.args[1]
    if lhs.count(",") != 1 or not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None
    sa, sb = lhs.split(",")
    if not (len(sa) == len(sb) == len(out) >= 2) or len(set(sa)) != len(sa) or len(set(sb)) != len(sb):
        return None
    batch, (i, k), b_last = sa[:-2], sa[-2:], sb[-2:]
    if sb[:-2] != batch or out[:-2] != batch or len({i, k, *b_last} - set(batch)) != 3:
        return None
    if b_last[0] == k and out[-2:] == i + b_last[1] and b_last[1] != i:
        return a, b, False
    if b_last[1] == k and out[-2:] == i + b_last[0] and b_last[0] != i:
        return a, b, True
    return None


SDPAS = {aten.scaled_dot_product_attention.default}
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)


def sdpa_args(node) -> Optional[dict]:
    """``scaled_dot_product_attention``'s arguments by name, defaults filled in, or None."""
    if not is_op(node, SDPAS):
        return None
    args = dict(_SDPA_DEFAULTS, **dict(zip(_SDPA_PARAMS, node.args)), **node.kwargs)
    return args if set(args) == set(_SDPA_PARAMS) else None


def strip_full_slices(node):
    """Look through ``slice(x, d, 0, end>=size)`` that select everything (from ``x[:, :, None]``)."""
    while is_op(node, {aten.slice.Tensor}):
        src = node.args[0]
        d = node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        size = shape(src)[d]
        if (start in (None, 0)) and (end is None or end >= size) and step == 1:
            node = src
        else:
            break
    return node


def repeat_kv_source(node, heads: int) -> Optional[tuple[fx.Node, int]]:
    """(kv tensor (B, Hkv, S, D), rep) if ``node`` is kv repeated to ``heads`` heads, as HF's
    ``repeat_kv`` (unsqueeze/index None -> expand -> reshape), ``repeat_interleave(rep, dim=1)`` or a
    plain ``expand`` of a single kv head (MQA) write it."""
    if len(shape(node)) != 4:
        return None
    if is_op(node, {aten.repeat_interleave.self_int}):
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if dim in (1, -3) and isinstance(node.args[1], int) and len(node.args) <= 3:
            return node.args[0], int(node.args[1])
        return None
    if is_op(node, {aten.expand.default}) and shape(node.args[0])[1:2] == (1,) and heads > 1:
        src = node.args[0]
        if shape(src)[0] == shape(node)[0] and shape(src)[2:] == shape(node)[2:]:
            return src, heads
        return None
    if not is_op(node, VIEWS) or not is_op(node.args[0], {aten.expand.default}):
        return None
    e = node.args[0]
    u = strip_full_slices(e.args[0])
    if not (is_op(u, {aten.unsqueeze.default}) and u.args[1] in (2, -3)):
        return None
    src = strip_full_slices(u.args[0])
    B, Hkv, S, D = shape(src)
    es = shape(e)
    if len(es) != 5 or es[0] != B or es[1] != Hkv or es[3:] != (S, D) or shape(node) != (B, Hkv * es[2], S, D):
        return None
    return src, es[2]


def only_users_in(node: fx.Node, allowed: set) -> bool:
    return all(u in allowed for u in node.users)


def causal_from_constant(masked: torch.Tensor, sq: int, sk: int) -> bool:
    """True if boolean ``masked`` (True = position removed), broadcast to (..., sq, sk), is exactly the
    top-left causal pattern ``j > i`` in every batch/head slice."""
    if masked.dim() < 2 or masked.shape[-2] not in (1, sq) or masked.shape[-1] not in (1, sk):
        return False
    upper = torch.ones(sq, sk, dtype=torch.bool).triu(1)
    return bool((masked.to(torch.bool).expand(*masked.shape[:-2], sq, sk) == upper).all())
