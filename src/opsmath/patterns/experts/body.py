"""The experts family's body: one expert's computation, checked to be the same function in every expert
(up to the expert's own parameters), and emitted once for all routed rows.

An expert's body is every node between its routed indices (``tok``, ``pos``) and the value it adds into
the output (``contrib``). Two bodies are the same function when they match node for node: same op,
same constants, inputs that are the same node, corresponding body nodes, the routed indices, or
parameters of the same shape (the expert's own, e.g. ``experts.3.w1.weight``). Every op must treat rows
independently (pointwise ops, casts, GEMMs with a weight, splits and softmaxes along a feature dim), so
that running it once on all routed rows, sorted by expert, equals running it per expert.

Emission maps the per-expert weights of a GEMM to a grouped GEMM over their stack
(``src/opsmath/kernels/grouped_mm.py``) and any other per-expert parameter to a per-row gather of its stack.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import aten, val
from opsmath.kernels.grouped_gather import gather_wins
from opsmath.kernels.grouped_mm import grouped_op

ROW_SAFE = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
            aten.contiguous.default, aten.alias.default, aten.dropout.default, aten.type_as.default}
FEATURE_DIM = {aten.softmax.int: 1, aten._softmax.default: 1, aten.log_softmax.int: 1, aten.chunk.default: 2,
               aten.split.Tensor: 2, aten.split_with_sizes.default: 2, aten.unsqueeze.default: 1}
# dynamo's checks of a data-dependent size (``u0 >= 0``): read sizes, never values
BOOKKEEPING = {aten.sym_size.int, aten._assert_scalar.default, aten.sym_constrain_range_for_size.default,
               operator.ge, operator.le, operator.gt, operator.lt, operator.eq}
GEMMS = {aten.linear.default, aten.matmul.default, aten.mm.default}


@dataclass
class Expert:
    """One expert's occurrence in the loop."""
    eid: int                    # its index (the constant it is routed by)
    where: fx.Node              # torch.where(mask): the routed (token, slot) pairs
    tok: fx.Node                # the token of each routed pair
    pos: Optional[fx.Node]      # the slot (0..k-1) of each pair; None for top-1 routing by a 1-D index
    acc: fx.Node                # the op adding its contribution into the output
    contrib: fx.Node            # what it adds
    extra: tuple = ()           # accumulation nodes besides ``acc`` (``out[tok]`` and ``+=``)
    body: list = field(default_factory=list)


def _param(n) -> bool:
    """A parameter (an input of the graph), or one expert's slice ``w[i]`` of a stacked one."""
    if isinstance(n, fx.Node) and n.target is aten.select.int and n.args[1] == 0 and isinstance(n.args[2], int):
        n = n.args[0]
    return isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr") and isinstance(val(n), torch.Tensor)


def id_chain(n, eid: int) -> Optional[tuple[fx.Node, list]]:
    """``(t.select(d, eid), dims)`` when ``n`` is that select under ``unsqueeze(dims[0])`` ... (outermost
    last): a column picked by the expert's own id, e.g. ``probs[:, i, None]``."""
    dims = []
    while isinstance(n, fx.Node) and n.target is aten.unsqueeze.default:
        dims.append(n.args[1] % val(n).dim())
        n = n.args[0]
    if isinstance(n, fx.Node) and n.target is aten.select.int and n.args[2] == eid and not _param(n):
        return n, dims[::-1]
    return None


def _slices(ps: list) -> Optional[tuple[fx.Node, int]]:
    """``(w, first)`` when ``ps`` are ``w[first], w[first + 1], ...`` of one stacked parameter."""
    if not all(p.target is aten.select.int for p in ps) or len({p.args[0] for p in ps}) != 1:
        return None
    first = ps[0].args[2]
    return (ps[0].args[0], first) if [p.args[2] for p in ps] == list(range(first, first + len(ps))) else None


def body_of(ex: Expert, position: dict) -> list[fx.Node] | str:
    """The nodes computing ``ex.contrib`` from the routed indices, in graph order (``position``: node ->
    index in the graph); a reason if a value inside is read by anything outside the expert."""
    start, stop = {ex.tok, ex.pos} - {None}, {ex.acc, *ex.extra}
    reach, todo = set(), list(start)          # everything downstream of the indices, up to the output
    while todo:
        for u in todo.pop().users:
            if u not in reach and u not in stop:
                reach.add(u)
                todo.append(u)
    inside, todo = set(), [ex.contrib]
    while todo:
        n = todo.pop()
        if n in reach and n not in inside:
            inside.add(n)
            todo.extend(n.all_input_nodes)
    allowed = inside | stop
    for n in inside:
        if any(u not in allowed and u.target not in BOOKKEEPING for u in n.users):
            return f"{n.name}, inside expert {ex.eid}, is also read outside it"
    return sorted(inside, key=position.__getitem__)


class Correspondence:
    """How expert ``e``'s body maps onto expert 0's: body nodes by position, parameters by use."""

    def __init__(self, first: Expert):
        self.first = first
        self.index = {n: i for i, n in enumerate(first.body)}
        self.params: dict[fx.Node, list[fx.Node]] = {}    # expert 0's parameter -> one per expert
        self.by_id: set[fx.Node] = set()    # ``t.select(d, i)`` outside the body, i the expert's own id

    def add(self, ex: Expert) -> Optional[str]:
        if len(ex.body) != len(self.first.body):
            return f"expert {ex.eid} computes something else ({len(ex.body)} ops, expert 0 {len(self.first.body)})"
        mine = {n: i for i, n in enumerate(ex.body)}
        params: dict[fx.Node, fx.Node] = {}
        for a, b in zip(self.first.body, ex.body):
            if a.target != b.target or not self._same((a.args, a.kwargs), (b.args, b.kwargs), ex, mine, params):
                return f"expert {ex.eid} differs from expert 0 at {b.name} ({a.name} there)"
        for p0, p in params.items():
            self.params.setdefault(p0, [p0]).append(p)
        return None

    def _same(self, x, y, ex, mine, params) -> bool:
        if isinstance(x, (list, tuple)):
            return type(x) is type(y) and len(x) == len(y) and all(
                self._same(a, b, ex, mine, params) for a, b in zip(x, y))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(self._same(x[k], y[k], ex, mine, params) for k in x)
        if not isinstance(x, fx.Node) or not isinstance(y, fx.Node):
            return not isinstance(x, torch.SymInt) and type(x) is type(y) and x == y
        if x in self.index or y in mine:
            return self.index.get(x) == mine.get(y)
        if (x, y) in ((self.first.tok, ex.tok), (self.first.pos, ex.pos)) or x is y:
            return True
        cx, cy = id_chain(x, self.first.eid), id_chain(y, ex.eid)
        if cx is not None and cy is not None and cx[0].args[:2] == cy[0].args[:2] and cx[1] == cy[1]:
            self.by_id.add(x)                                # e.g. probs[:, i, None] of expert i
            return True
        if _param(x) and _param(y) and x.op == y.op:     # each expert's own copy of one parameter
            ok = val(x).shape == val(y).shape and val(x).dtype == val(y).dtype
            return ok and params.setdefault(x, y) is y
        return (x.op == y.op == "call_function" and x.target == y.target
                and self._same((x.args, x.kwargs), (y.args, y.kwargs), ex, mine, params))


def _dim(select: fx.Node) -> int:
    return select.args[1] % val(select.args[0]).dim()


def _is(a, b) -> bool:
    """Whether sizes ``a`` and ``b`` are the same, without guarding on a data-dependent one."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr
    return a == b


def unsupported(first: Expert, params: dict, rows, by_id: set) -> Optional[str]:
    """A reason when some op of the body does not treat rows independently (``rows``: the routed row
    count of expert 0, a symbolic size)."""
    inside = set(first.body)
    for n in first.body:
        if n.target is operator.getitem:
            continue
        reason = _row_reason(n, rows) or _op_reason(n, first, params, rows, by_id, inside)
        if reason:
            return reason
    return None


def _row_reason(n: fx.Node, rows) -> Optional[str]:
    """A reason when ``n`` is not a tensor op whose first dim (or second, after a leading 1) is the rows."""
    v = val(n)
    if n.op != "call_function" or not isinstance(v, torch.Tensor):
        return f"{n.name}: {n.target} in an expert is not supported"
    if v.dim() == 0 or not (_is(v.shape[0], rows) or (v.dim() > 1 and _is(v.shape[0], 1) and _is(v.shape[1], rows))):
        return f"{n.name} mixes the routed rows ({tuple(v.shape)})"
    return None


def _op_reason(n: fx.Node, first: Expert, params: dict, rows, by_id: set, inside: set) -> Optional[str]:
    """A reason when op ``n`` of the body mixes rows, or reads expert i's column or parameters in a way
    the grouped form cannot take; None when it treats rows independently."""
    t = n.target
    if t is aten.index.Tensor:      # a per-token (or per token and slot) gather of a shared tensor
        return _gather_reason(n, first, params, by_id, inside)
    if any(a in by_id for a in n.args if isinstance(a, fx.Node)):
        return f"{n.name} reads expert i's column other than by the routed indices"
    if t in GEMMS:
        w = n.args[1]
        if w in inside:
            return f"{n.name}: a GEMM of two routed values"
        if w in params and val(n.args[0]).dim() != 2:
            return f"{n.name}: a per-expert GEMM on a {val(n.args[0]).dim()}-D input"
        return None
    if t in FEATURE_DIM:
        d = n.args[FEATURE_DIM[t]] if len(n.args) > FEATURE_DIM[t] else n.kwargs.get("dim", 0)
        if d % max(val(n.args[0]).dim() + (t is aten.unsqueeze.default), 1) == 0:
            return f"{n.name}: {t} along the row dim"
        return None
    if t in (aten.view.default, aten.reshape.default) and _is(val(n).shape[0], rows):
        return None
    if t in ROW_SAFE or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
        if any(a in params for a in n.args if isinstance(a, fx.Node)) and t not in \
                (aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor):
            return f"{n.name}: per-expert parameter in {t}"
        return None
    return f"{n.name}: {t} in an expert is not supported"


def _gather_reason(n: fx.Node, first: Expert, params: dict, by_id: set, inside: set) -> Optional[str]:
    """A reason when ``index`` node ``n`` is not a gather of a shared tensor by the routed indices."""
    routed, src = (first.tok, first.pos, None), n.args[0]
    if src in by_id and (_dim(id_chain(src, first.eid)[0]) != len(n.args[1])
                         or any(d < len(n.args[1]) for d in id_chain(src, first.eid)[1])):
        return f"{n.name}: gathers expert i's column {src.name} along another dim"
    if any(a in by_id for a in n.args[1]):
        return f"{n.name}: indexes by expert i's column"
    if src in inside or src in params or any(i not in routed for i in n.args[1]):
        return f"{n.name}: a gather that is not by the routed indices"
    return None


class Emitter:
    """Emits expert 0's body once over all routed rows, sorted by expert (``routed``: ``tok``, ``pos``,
    ``gid`` (each row's expert) and ``offs``, graph nodes)."""

    def __init__(self, ctx, first: Expert, corr: Correspondence, routed: dict, like: fx.Node):
        self.ctx, self.first, self.params, self.routed, self.like = ctx, first, corr.params, routed, like
        self.by_id = corr.by_id
        self.env: dict[fx.Node, fx.Node] = {}
        self.stacks: dict[fx.Node, fx.Node] = {}
        self.gemms: list[str] = []
        self.unread: list[fx.Node] = []   # GEMM inputs a gathered GEMM reads through the index instead
        self.casts: dict[tuple, fx.Node] = {}   # (tokens, dtype) -> their cast, for gathered GEMMs

    def call(self, target, *args, **kwargs) -> fx.Node:
        return self.ctx.call(target, args, self.like, kwargs)

    def stack(self, p0: fx.Node) -> fx.Node:
        """The experts' copies of parameter ``p0`` as one [E, ...] tensor: a view of the stacked parameter
        they are slices of, else a stack (a copy)."""
        if p0 not in self.stacks:
            ps = list(self.params[p0])
            sliced = _slices(ps)
            if sliced is not None:
                w, first = sliced
                self.stacks[p0] = w if (first, len(ps)) == (0, val(w).shape[0]) else \
                    self.call(aten.slice.Tensor, w, 0, first, first + len(ps))
            else:
                self.stacks[p0] = self.call(aten.stack.default, ps)
        return self.stacks[p0]

    def arg(self, a):
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(x) for x in a)
        if a is self.first.tok:
            return self.routed["tok"]
        if a is self.first.pos:
            return self.routed["pos"]
        return self.env.get(a, a) if isinstance(a, fx.Node) else a

    def gathered(self, p0: fx.Node, like_rank: int) -> fx.Node:
        """Each row's expert's copy of parameter ``p0``, shaped to broadcast against a row value."""
        rows = self.call(aten.index.Tensor, self.stack(p0), [self.routed["gid"]])
        pad = like_rank - 1 - val(p0).dim()
        if pad > 0:
            rows = self.call(aten.view.default, rows, [-1] + [1] * pad + list(val(p0).shape))
        return rows

    def masked(self, rows: fx.Node) -> fx.Node:
        """``rows`` with those routed to no expert zeroed, where routing can leave any (``valid``). A
        grouped GEMM leaves its output rows past the last group undefined on CUDA, and its input
        gradient's: zeroing both its input and its output keeps them out of every value and gradient
        (the ``where`` on the input zeroes the gradient rows the backward leaves undefined)."""
        valid = self.routed["valid"]
        if valid is None:
            return rows
        return self.call(aten.where.ScalarOther, self.call(aten.unsqueeze.default, valid, -1), rows, 0.0)

    def gemm(self, n: fx.Node) -> fx.Node:
        x, w = self.arg(n.args[0]), n.args[1]
        if w not in self.params:
            return self.call(n.target, *self.arg(n.args), **self.arg(n.kwargs))
        weights = self.stack(w)                                  # [E, N, K] (linear) or [E, K, N]
        cdt = val(n).dtype
        autocast = cdt in (torch.float16, torch.bfloat16)   # autocast's casts, explicit: the grouped op sees raw inputs
        weights = self.ctx.cast(weights, cdt, self.like) if autocast else weights
        linear = n.target is aten.linear.default
        if linear:
            weights = self.call(aten.transpose.int, weights, 1, 2)
        k, out = val(w).shape[-1 if linear else 0], val(n).shape[-1]
        # (FP8 experts, which run after, take grouped GEMMs over sorted rows: those stay as they are)
        src = None if "fp8_experts" in self.ctx.families else self._token_rows(x)
        if src is not None and gather_wins(val(x).shape[0], val(src).shape[0], k, out, val(weights).shape[0], cdt,
                                           val(src).device, linear):
            self.gemms.append("opsmath::grouped_mm_gather")   # zeros past the last group: nothing to mask
            self.unread.append(x)   # the gathered rows, erased at the end of ``emit`` where nothing else reads them
            if (src, cdt) not in self.casts:   # the tokens cast once for every GEMM that reads them
                self.casts[src, cdt] = self.ctx.cast(src, cdt, self.like)
            y = self.call(torch.ops.opsmath.grouped_mm_gather.default, self.casts[src, cdt], self.routed["tok"],
                          weights, self.routed["offs"])
        else:
            x = self.ctx.cast(x, cdt, self.like) if autocast else x
            op = grouped_op(val(x).dtype, val(weights).dtype, k, out)
            self.gemms.append("torch._grouped_mm" if op is aten._grouped_mm.default else "opsmath::grouped_mm")
            y = self.masked(self.call(op, self.masked(x), weights, self.routed["offs"]))
        bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        if bias is not None:
            b = self.gathered(bias, 2) if bias in self.params else bias
            y = self.call(aten.add.Tensor, y, self.ctx.cast(b, cdt, self.like) if cdt != val(b).dtype else b)
        return y

    def _token_rows(self, x: fx.Node) -> Optional[fx.Node]:
        """The [T, K] tensor whose rows the emitted GEMM input ``x`` gathers by the routed tokens (``t[tok]``,
        or HF's ``t[None, tok].reshape(-1, K)``: ``index(unsqueeze(t, 0), [None, tok])``), for
        ``grouped_mm_gather``; else None."""
        if not isinstance(x, fx.Node):
            return None
        if x.op == "call_function" and x.target in (aten.reshape.default, aten.view.default) \
                and val(x).dim() == 2 and isinstance(x.args[0], fx.Node):
            x = x.args[0]
        if not (x.op == "call_function" and x.target is aten.index.Tensor and isinstance(x.args[0], fx.Node)):
            return None
        src, idx = x.args[0], list(x.args[1])
        if idx == [None, self.routed["tok"]] and src.op == "call_function" and src.target is aten.unsqueeze.default \
                and src.args[1] == 0 and isinstance(src.args[0], fx.Node):   # x[None, tok]: unsqueeze, then index
            src, idx = src.args[0], [self.routed["tok"]]
        if val(src).dim() != 2 or idx != [self.routed["tok"]]:
            return None
        sizes = (val(x).numel(), val(src).shape[0], val(src).shape[1])
        return src if all(isinstance(d, int) for d in sizes) else None

    def emit(self) -> fx.Node:
        for n in self.first.body:
            if n.target in GEMMS:
                self.env[n] = self.gemm(n)
                continue
            if n.target is aten.index.Tensor and n.args[0] in self.by_id:   # t[:, i][tok] = t[tok, i]
                column, dims = id_chain(n.args[0], self.first.eid)
                y = self.call(aten.index.Tensor, column.args[0], [*self.arg(n.args[1]), self.routed["eid"]])
                for d in dims:      # the gathered dims became one
                    y = self.call(aten.unsqueeze.default, y, d - len(n.args[1]) + 1)
                self.env[n] = y
                continue
            rank = val(n).dim() if isinstance(val(n), torch.Tensor) else 0
            args = [self.gathered(a, rank) if a in self.params else self.arg(a) for a in n.args]
            self.env[n] = self.call(n.target, *args, **self.arg(n.kwargs))
        self.ctx.erase_dead(self.unread)
        return self.env[self.first.contrib]
