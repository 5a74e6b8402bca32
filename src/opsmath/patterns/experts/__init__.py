"""Mixture-of-experts: a Python loop over experts to one grouped computation over all routed tokens.

As models write it (the Mistral reference, Hugging Face's per-expert loops, most hand-written MoEs)::

    weights, selected = torch.topk(router_logits, k)                       # [T, k] each
    for i, expert in enumerate(self.experts):
        tok, slot = torch.where(selected == i)                             # or one_hot(selected)[..., i]
        out[tok] += weights[tok, slot, None] * expert(x[tok])              # or out.index_add_(0, tok, ...)

Each ``torch.where`` has a data-dependent size: torch.compile either breaks the graph there (its
default) or, with ``capture_dynamic_output_shape_ops`` (which opsmath's frames set), carries an unbacked
size per expert. The rewrite replaces the loop by one static-shape computation over the S = T*k
routed (token, slot) pairs, with the same routing, weights and sums:

    key = selected.flatten() - first_id;  order = stable argsort(key)       # rows sorted by expert
    tok, slot = order // k, order % k;  offs = cumsum(count of each expert)
    y = body(x[tok], weights[tok, slot], ...)   # every per-expert GEMM one grouped GEMM (src/opsmath/kernels/grouped_mm.py)
    out = init + y[inverse(order)].view(T, k, D).sum(1)

Constraints (else the loop stays as written, the report says why): the experts are routed by
consecutive constants from one index tensor; every expert computes the same function of its rows
(``body.py``); each adds into one fresh accumulator (``zeros``, ``zeros_like``) by
``out[tok] += c``, ``out.index_put_((tok,), c, accumulate=True)`` or ``index_add(_)``, read by nothing
before the loop ends. ``out[tok] += c`` keeps one write per repeated token, so it is rewritten only when
the routing comes from ``topk`` (distinct experts per token). Rows whose index falls outside the experts
(expert parallelism, a capacity sentinel) add nothing, as in the loop; token dropping stays the model's.
Caveat: the sums run in another order than the loop's (within the tolerance rule, not bitwise).
"""
from __future__ import annotations

import operator
import re
from typing import Optional

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import aten, shape, val
from opsmath.capture.frames import source_location
from opsmath.kernels.grouped_mm import new_load_site
from opsmath.rewrite.match import RewriteContext, node_line
from opsmath.rewrite.rules import Rule, register_rule

from opsmath.patterns.experts.library import gather_rows, swap_library_fallbacks
from opsmath.patterns.experts.regional import ACTIVE, expert_lists, trace_once
from opsmath.patterns.experts.body import BOOKKEEPING, Correspondence, Emitter, Expert, body_of, unsupported
from opsmath.patterns.experts.spellings import ASSIGN, accumulation, from_topk, masks_to_indices, routing

WHERES = (aten.where.default, aten.nonzero_numpy.default)   # torch.where(m), torch.nonzero(m, as_tuple=True)
EMPTY = {aten.empty_like.default, aten.empty.memory_format}
ZEROS = {aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default}


class Loop:
    """A recognized loop: the experts in accumulation order, the accumulator and what the body needs."""

    def __init__(self, sel, k, experts, init, corr, mask, readers, bookkeeping):
        self.sel, self.k, self.experts, self.init, self.corr = sel, k, experts, init, corr
        self.mask, self.readers, self.bookkeeping = mask, readers, bookkeeping
        self.first = min(experts, key=lambda e: e.eid)
        self.lo = self.first.eid


def _experts(graph: fx.Graph, sel: fx.Node) -> list[tuple[fx.Node, int, tuple]]:
    found = []
    for w in [n for t in WHERES for n in graph.find_nodes(op="call_function", target=t)]:
        r = routing(w)
        if r is not None and r[0] is sel:
            found.append((w, r[1], r[2]))
    return found


def _occurrence(where, eid, axes, position) -> Expert | str | None:
    outs = {u.args[1]: u for u in where.users if u.target is operator.getitem}
    tok = outs.get(axes.index(0))
    pos = outs.get(axes.index(1)) if len(axes) == 2 else None
    if tok is None or len(axes) > 2:
        return f"expert {eid}: routing by a {len(axes)}-D index"
    acc = accumulation(tok)
    if acc is None and any(u.target in (aten.slice.Tensor, aten.narrow.default) for u in tok.users):
        return f"expert {eid} keeps only some of its rows (a capacity limit): token dropping stays as written"
    if acc is None:
        return None
    ex = Expert(eid, where, tok, pos, acc[1], acc[2], () if acc[3] is ASSIGN else acc[3])
    ex.acc_in, ex.assign = acc[0], acc[3] is ASSIGN
    body = body_of(ex, position)
    if isinstance(body, str):
        return body
    ex.body = body
    return ex


def _bookkeeping(ex: Expert) -> Optional[list[fx.Node]]:
    """The shape assertions on ``ex``'s routed indices (dynamo's checks of the unbacked sizes); None if
    the indices are read by anything else outside the expert."""
    inside = {*ex.body, ex.acc, *ex.extra}
    found, todo = [], [u for g in (ex.tok, ex.pos, *ex.body) if g is not None for u in g.users if u not in inside]
    while todo:
        n = todo.pop()
        if n in found:
            continue
        if n.target not in BOOKKEEPING:
            return None
        found.append(n)
        todo.extend(n.users)
    return found


def _chain(experts: list[Expert], position: dict) -> tuple[fx.Node, list[fx.Node]] | str:
    """The accumulator and the nodes reading its final value, or why the loop is not one sum."""
    experts.sort(key=lambda e: position[e.acc])
    init = experts[0].acc_in
    aliases = [init]
    for ex in experts:
        if ex.acc_in not in aliases:
            return f"expert {ex.eid} adds into another tensor"
        aliases.append(ex.acc)
    fresh = ZEROS | (EMPTY if all(ex.assign for ex in experts) else set())
    if init.target not in fresh:
        return f"the experts add into {init.name}, not a fresh zeros tensor"
    inside = {n for ex in experts for n in (ex.acc, *ex.extra)}
    end, readers = position[experts[-1].acc], []
    for a in aliases:
        for u in a.users:
            if u in inside:
                continue
            if position[u] < end:
                return f"{u.name} reads the output before the last expert has added to it"
            readers.append(u)
    return init, readers


def plan_loop(graph: fx.Graph, where: fx.Node) -> Loop | str | None:
    r = routing(where)
    if r is None:
        return None
    sel = r[0]
    found = _experts(graph, sel)
    if min(found, key=lambda f: f[1])[0] is not where or len(found) < 2:
        return None
    position = {n: i for i, n in enumerate(graph.nodes)}
    experts = [_occurrence(*f, position) for f in found]
    if all(ex is None for ex in experts):
        return None            # rows picked per id but never added into one output: not a MoE loop
    for ex in experts:
        if ex is None:
            return "some experts' rows are not added into the output by index"
        if isinstance(ex, str):
            return ex
    ids = sorted(ex.eid for ex in experts)
    if ids != list(range(ids[0], ids[0] + len(ids))):
        return f"experts routed by ids {ids}, not consecutive"
    chain = _chain(experts, position)
    if isinstance(chain, str):
        return chain
    init, readers = chain
    topk = from_topk(sel)
    if topk is None and any(ex.extra for ex in experts):
        return "out[tok] += ... keeps one write per repeated token, and the routing is not from topk"
    return _finish(sel, experts, init, readers, topk)


def _finish(sel, experts, init, readers, topk) -> Loop | str:
    first = min(experts, key=lambda e: e.eid)
    corr = Correspondence(first)
    for ex in experts:
        if ex is not first and (why := corr.add(ex)) is not None:
            return why
    rows = val(first.tok).shape[0]
    if (why := unsupported(first, corr.params, rows, corr.by_id)) is not None:
        return why
    if not corr.params:
        return "no parameter differs between the experts"
    book = [_bookkeeping(ex) for ex in experts]
    if any(b is None for b in book):
        return "the routed indices are read outside the experts"
    k = shape(sel)[1] if len(shape(sel)) == 2 else 1
    if len(shape(init)) != 2 or shape(init)[0] != shape(sel)[0] or len(shape(first.contrib)) != 2:
        return f"output {tuple(shape(init))} is not one row per token"
    n_ids = len(experts)
    proven = topk is not None and first.eid == 0 and shape(topk.args[0])[-1] == n_ids and k == topk.args[1]
    return Loop(sel, k, experts, init, corr, not proven, readers, [n for b in book for n in b])


def tracing_settings(model: torch.nn.Module) -> dict:
    """The dynamo settings under which the rule sees ``model``'s experts: none unless it looks like a
    mixture of experts (a submodule named ``*expert*``, or a 3-D parameter: experts' weights stacked), so that
    other models (a boolean-mask loss) keep torch.compile's graph break at a data-dependent size. Where it
    does, each ``torch.where`` is traced (an unbacked size). Experts held as modules (``expert_lists``), which
    a forward loops over, make a new unbacked size per expert, where fake-tensor
    caching costs more than it saves (a 64-expert loop traces about 20% faster without)."""
    names = [name.rsplit(".", 1)[-1].lower() for name, _ in model.named_modules()]
    if not any("expert" in n for n in names) and not any(p.dim() == 3 for p in model.parameters()):
        return {}
    lists = any(expert_lists(m) for m in model.modules())
    return dict(capture_dynamic_output_shape_ops=True, **(dict(fake_tensor_cache_enabled=False) if lists else {}))


def _routed(ctx: RewriteContext, loop: Loop, like: fx.Node) -> dict:
    """The rows sorted by expert: ``tok``, ``pos``, ``gid`` (each row's expert, from 0; ``eid`` its id),
    ``offs`` (int32 ends of each expert's rows), ``order`` (the sort permutation), ``valid`` (rows routed
    to an expert; None when the routing is known to hit one always), ``site`` (its expert-load record)."""
    def call(target, *args, **kwargs):
        return ctx.call(target, args, like, kwargs)
    n = len(loop.experts)
    key = call(aten.reshape.default, loop.sel, [-1])
    if loop.lo:
        key = call(aten.sub.Tensor, key, loop.lo)
    if loop.mask:
        inside = call(aten.logical_and.default, call(aten.ge.Scalar, key, 0), call(aten.lt.Scalar, key, n))
        key = call(aten.where.ScalarOther, inside, key, n)
    srt = call(aten.sort.stable, key, stable=True, dim=0)
    sorted_key, order = call(operator.getitem, srt, 0), call(operator.getitem, srt, 1)
    k = loop.k
    two_d = len(shape(loop.sel)) == 2          # [T, k] (a slot per token, k = 1 included) or [T]
    tok = call(aten.div.Tensor_mode, order, k, rounding_mode="floor") if k > 1 else order
    pos = call(aten.remainder.Scalar, order, k) if two_d else None
    bounds = call(aten.arange.start, 1, n + 1, dtype=val(sorted_key).dtype, device=val(sorted_key).device)
    offs = call(aten.searchsorted.Tensor, sorted_key, bounds, out_int32=True)
    site = new_load_site(n, _module_path(like))
    offs = call(torch.ops.opsmath.expert_load.default, offs, site)
    gid = call(aten.clamp.default, sorted_key, None, n - 1) if loop.mask else sorted_key
    valid = call(aten.lt.Scalar, sorted_key, n) if loop.mask else None
    eid = call(aten.add.Tensor, gid, loop.lo) if loop.lo else gid
    return dict(tok=tok, pos=pos, gid=gid, eid=eid, offs=offs, order=order, valid=valid, site=site)


def _module_path(node: fx.Node) -> str:
    """The module the loop runs in (``layers.1.moe``), else its source line; in a graph that modules share
    (``regional.py``), theirs."""
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    if stack:
        path = re.sub(r"\[(\d+)\]", r".\1", re.sub(r"^L\['\w+'\]\.?", "", list(stack.values())[-1][0]))
    if ACTIVE:
        return ACTIVE[-1] + (f" ({path})" if path else "")
    return path or ("model" if stack else source_location(node)[0])


def _combine(ctx: RewriteContext, loop: Loop, routed: dict, c: fx.Node, like: fx.Node) -> fx.Node:
    """``init + sum over slots`` of the sorted contributions ``c`` (rows routed to no expert already
    zeroed: ``Emitter.masked``), back in token order."""
    def call(target, *args, **kwargs):
        return ctx.call(target, args, like, kwargs)
    order = routed["order"]
    ranks = call(aten.sub.Tensor, call(aten.cumsum.default, call(aten.ones_like.default, order), 0), 1)
    inverse = call(aten.scatter.src, order, 0, order, ranks)
    out = call(aten.index.Tensor, c, [inverse])
    if loop.k > 1:
        out = call(aten.sum.dim_IntList, call(aten.view.default, out, [-1, loop.k, shape(c)[-1]]), [1])
    if val(out).dtype != val(loop.init).dtype:
        out = call(aten._to_copy.default, out, dtype=val(loop.init).dtype)
    return out


class ExpertsRule(Rule):
    name = "experts"
    anchors = WHERES
    dynamic_shapes = True
    data_dependent_shapes = True

    def apply(self, ctx: RewriteContext) -> None:
        swap_library_fallbacks(ctx, self.name)
        if "fp8_experts" not in ctx.families:   # which takes grouped GEMMs over sorted rows
            gather_rows(ctx, self.name)
        masks_to_indices(ctx.graph)
        super().apply(ctx)

    def match(self, ctx: RewriteContext, where: fx.Node):
        return plan_loop(ctx.graph, where)

    def prepare(self, model) -> list[str]:
        """Hugging Face experts set to ``experts_implementation="eager"`` loop over the experts that got
        tokens (``for i in expert_hit``: a graph break per expert, which no graph rewrite can undo):
        switched to the library's own ``"grouped_mm"``, the same function. Repeated loops over many experts
        are traced once for all their modules (``regional.py``)."""
        notes = []
        for m in model.modules():
            cfg = getattr(m, "config", None)
            has_experts = any(getattr(cfg, k, 0) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
            if has_experts and getattr(cfg, "_experts_implementation", None) == "eager" \
                    and hasattr(m, "set_experts_implementation"):
                try:
                    m.set_experts_implementation("grouped_mm")
                except (ValueError, KeyError, ImportError) as e:
                    notes.append(f"experts: {type(m).__name__} keeps experts_implementation='eager' ({e})")
                    continue
                notes.append(f"experts: {type(m).__name__}'s experts_implementation 'eager' (a graph break per "
                             "expert) switched to its 'grouped_mm' (the same function)")
        return notes + trace_once(model)

    def emit(self, ctx: RewriteContext, where: fx.Node, loop: Loop) -> None:
        last = loop.experts[-1].acc
        before = [node_line(n) for n in [loop.first.where, *loop.first.body, loop.first.acc]]
        with ctx.graph.inserting_before(last):
            routed = _routed(ctx, loop, where)
            body = Emitter(ctx, loop.first, loop.corr, routed, where)
            out = _combine(ctx, loop, routed, body.masked(body.emit()), last)
        for r in loop.readers:
            for a in [loop.init, *(ex.acc for ex in loop.experts)]:
                r.replace_input_with(a, out)
        replaced = _erase(ctx, loop)
        n, k = len(loop.experts), loop.k
        gemms = sorted(set(body.gemms))
        ctx.replaced(self.name, where, replaced,
                     f"grouped experts ({n} experts, top-{k}, {len(body.gemms)} grouped GEMMs: {', '.join(gemms)})",
                     before, experts=n, top_k=k, gemms=body.gemms, masked=loop.mask,
                     load_site=routed["site"])


def _erase(ctx: RewriteContext, loop: Loop) -> list[fx.Node]:
    """Remove the loop (every expert's nodes, the shape assertions, the accumulator); the replaced ones."""
    doomed = set(loop.bookkeeping) | {loop.init}
    for ex in loop.experts:
        doomed |= {ex.acc, *ex.extra, *ex.body, ex.tok, ex.where} | ({ex.pos} if ex.pos is not None else set())
    doomed |= {u for ex in loop.experts for u in ex.where.users}
    position = {n: i for i, n in enumerate(ctx.graph.nodes)}
    inputs, gone = set(), []
    for n in sorted(doomed, key=position.__getitem__, reverse=True):
        if not n.users:
            inputs.update(n.all_input_nodes)
            ctx.graph.erase_node(n)
            n._erased = True
            gone.append(n)
    ctx.erase_dead(inputs - doomed)
    return gone[::-1]


PATTERN = register_rule(ExpertsRule())
