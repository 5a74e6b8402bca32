"""Match and replace: the driver every pattern family plugs into.

A rule (one file per family in ``src/opsmath/patterns/``, the interface in ``rules.py``) is offered each of its
anchor nodes, checks constraints from node metadata, and either rewrites the occurrence
(``ctx.replaced``) or leaves it alone and says why (``ctx.declined``), through ``RewriteContext.offer``.
Matching never changes semantics: when unsure, a rule declines.
"""
from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from opsmath.kernels._common import new_seed, new_seeds

from opsmath.rewrite import price
from opsmath.rewrite.canonicalize import aten, dtype, private_temporary
from opsmath.capture.frames import source_location
from opsmath.capture.lower import Captured, split_size_calls
from opsmath.rewrite.normalize import drop_dead_code, einsums_as_matmuls, impossible_masks, type_as_casts
from opsmath.rewrite.unmatched import flag_unmatched

log = logging.getLogger("opsmath")


@dataclass
class Match:
    """One rewrite: ``pattern`` replaced ``nodes`` (names in the captured graph) at ``location``."""
    pattern: str
    location: str
    code: str
    nodes: list[str]
    replacement: str
    before: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    anchor: str = ""              # the node ``optimize(skip=[f"{pattern}@{anchor}"])`` refers to
    inserted: list[str] = field(default_factory=list)   # names of the nodes its replacement inserted
    saved_delta: Optional[int] = None   # bytes saved for backward: replacement minus replaced (estimate)

    @property
    def key(self) -> str:
        return f"{self.pattern}@{self.anchor}"

    def to_dict(self) -> dict:
        return dict(pattern=self.pattern, location=self.location, code=self.code, nodes=self.nodes,
                    replacement=self.replacement, before=self.before, details=self.details, anchor=self.anchor,
                    saved_delta=self.saved_delta)


@dataclass
class Decline:
    """An occurrence a pattern recognized but left alone, with the reason."""
    pattern: str
    location: str
    code: str
    node: str
    reason: str

    def to_dict(self) -> dict:
        return dict(pattern=self.pattern, location=self.location, code=self.code, node=self.node,
                    reason=self.reason)


def node_line(n: fx.Node) -> str:
    """``name = op(args)`` in the style of GraphModule.code, for report snippets."""
    def fmt(a):
        if isinstance(a, fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(fmt(x) for x in a) + "]"
        return repr(a)
    target = getattr(n.target, "__name__", str(n.target)) if n.op == "call_function" else str(n.target)
    if isinstance(n.target, torch._ops.OpOverload):
        target = str(n.target).replace(".default", "")
    args = ", ".join([fmt(a) for a in n.args] + [f"{k}={fmt(v)}" for k, v in n.kwargs.items()])
    return f"{n.name} = {target}({args})"


class RewriteContext:
    """What a pattern needs: the graph, known constants, and the record of what happened."""

    def __init__(self, captured: Captured, skip: Optional[set[str]] = None, inductor: bool = False,
                 inputs: Optional[list] = None, budget: bool = False, priced: frozenset = frozenset()):
        self.captured = captured
        self.priced = priced         # families whose occurrences are kept only where they measure faster
        self.put_back: set[str] = set()   # nodes of priced occurrences restored (declined as a whole)
        self.budget = budget         # a memory budget is planned: rules that save memory may be worth it
        self.inputs = inputs         # the real example inputs, by placeholder (read only for what they are)
        self.gm = captured.gm
        self.inductor = inductor     # Inductor compiles the rewritten graph (else it runs op by op)
        self.graph = captured.gm.graph
        self.constants = captured.constants
        self.matches: list[Match] = []
        self.declines: list[Decline] = []
        self.skip = skip or set()
        self.families: set[str] = set()   # the families this run applies (``run_patterns``)
        self.fake_mode = _fake_mode_of(self.gm)
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self._grad_inputs = {n for n, rg in zip(placeholders, captured.requires_grad) if rg}

    def may_require_grad(self, node: fx.Node) -> bool:
        """Whether ``node`` depends on an input that requires grad (fake values do not record it).
        Conservative: a non-differentiable op on the way (comparisons, integer ops) still counts."""
        seen, todo = set(), [node]
        while todo:
            n = todo.pop()
            if n in self._grad_inputs:
                return True
            for x in n.all_input_nodes:
                if x not in seen:
                    seen.add(x)
                    todo.append(x)
        return False

    def allowed(self, pattern: str, anchor: fx.Node) -> bool:
        """Whether the user (``optimize(..., skip=...)``) lets this occurrence be rewritten: ``skip``
        holds family names (``"attention"``), single occurrences (``"attention@softmax_3"``, the node the
        report names), or the modules an occurrence lies in, by name or glob (``"fp8_linear@lm_head"``,
        ``"attention@layers.*.self_attn"``; a name also covers what lies inside that module)."""
        if pattern in self.skip or f"{pattern}@{anchor.name}" in self.skip:
            return False
        wanted = [s.split("@", 1)[1] for s in self.skip if s.startswith(pattern + "@")]
        return not wanted or not any(fnmatch.fnmatchcase(path, w) or path.startswith(w + ".")
                                     for path in module_paths(anchor) for w in wanted)

    def offer(self, pattern: str, anchor: fx.Node, plan, emit: Callable[[], None]) -> None:
        """One occurrence a pattern analysed: ``plan`` is either the reason to leave it alone (a str)
        or what to emit. ``emit()`` runs unless the reason exists or the user skipped the occurrence;
        a declined occurrence is recorded for the report."""
        if isinstance(plan, str):
            self.declined(pattern, anchor, plan)
        elif not self.allowed(pattern, anchor):
            self.declined(pattern, anchor, "skipped by the user")
        else:
            snap = price.Snapshot.of(self.graph) if pattern in self.priced else None
            present, count = set(self.graph.nodes), len(self.matches)
            emit()
            if len(self.matches) > count:
                self.matches[-1].inserted = [n.name for n in self.graph.nodes if n not in present]
                if snap is not None:
                    self._price(pattern, anchor, snap)

    def _price(self, pattern: str, anchor: fx.Node, snap) -> None:
        """Keep the rewrite just emitted only where opsmath's op measures faster than Inductor's compile
        of the nodes it replaced and saves no more for backward (under a budget: or saves less;
        ``price.judged``); else put those nodes back, as without pricing, and decline with the times and
        bytes or with why it was not measured (symbolic sizes, a failure while measuring). An
        emit that cannot be undone (it moved other nodes) stays, the report saying it was not priced."""
        cuts = price.regions(self.graph, snap)
        if cuts is None:
            self.matches[-1].details["priced"] = "not priced: the rewrite does not cut out of the graph"
            return
        erased, inserted, original, replacement = cuts
        why = price.unpriced(original)
        k = None if why else price.key(original, replacement)
        why = why or price.over_budget(pattern, k)
        if why is not None:
            reason = f"left to Inductor, not priced: {why}"
        else:
            try:
                choice, ms, saved = price.verdict(pattern, k, original, replacement, self.may_require_grad)
            except Exception as e:
                log.info("opsmath: pricing %s at %s failed", pattern, anchor.name, exc_info=True)
                choice, ms, saved = f"{type(e).__name__}: {str(e)[:160]}", {}, {}
            reason = price.judged(choice, ms, saved, self.budget)
            if reason is None:
                self.matches[-1].details["priced"] = price.measured(ms, saved)
                return
        env = price.restore(self.graph, snap, erased, inserted)
        self.put_back.update(n.name for n in env.values())
        self.matches.pop()
        self.declined(pattern, env.get(anchor, anchor), reason)

    def declined(self, pattern: str, node: fx.Node, reason: str) -> None:
        loc, code = source_location(node)
        self.declines.append(Decline(pattern, loc, code, node.name, reason))
        log.info("opsmath: %s at %s left alone: %s", pattern, loc, reason)

    def replaced(self, pattern: str, anchor: fx.Node, nodes: Iterable[fx.Node], replacement: str,
                 before: list[str], **details) -> None:
        loc, code = source_location(anchor)
        self.matches.append(Match(pattern, loc, code, [n.name for n in nodes], replacement, before, details,
                                  anchor.name))

    def cast(self, t, dt: torch.dtype, like: fx.Node):
        """``t`` as ``dt``: ``t`` itself when it already is (or is None), else an inserted ``aten.to``
        (what autocast would have done to an op's inputs, made explicit for a fused op that sees them raw)."""
        if t is None or dtype(t) == dt:
            return t
        return self.call(aten.to.dtype, (t, dt), like)

    def call(self, target, args, like: fx.Node, kwargs=None) -> fx.Node:
        """Insert ``target(*args)`` at the current insertion point, inheriting ``like``'s source trace
        and getting ``meta["val"]`` from running ``target`` on the inputs' fake values, so later
        matches in the same pass can read shapes and dtypes of what was inserted."""
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        # (recompute / ac_graph_id / custom: a user's checkpoint region stays one when rewritten)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "recompute", "ac_graph_id", "custom"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
        if self.fake_mode is not None:
            fake = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            try:
                with self.fake_mode:
                    node.meta["val"] = target(*fake[0], **fake[1])
            except Exception as e:  # metadata only; _refresh_meta runs again at the end
                log.debug("opsmath: no fake value for %s: %s", node.name, e)
        return node

    def add_input(self, name: str, fake: torch.Tensor, like: fx.Node, **meta) -> fx.Node:
        """A new graph input after the others (``fake`` its value, ``meta`` added to its meta), static
        like the placeholder ``like`` (dynamo's metadata copied, with a source of its own); whoever runs
        the graph passes it (``fp8_weights.with_copies``)."""
        from torch._dynamo.source import ConstantSource
        last = list(self.graph.find_nodes(op="placeholder"))[-1]
        with self.graph.inserting_after(last):
            node = self.graph.placeholder(name)
        node.meta.update(meta, val=fake)
        if "dynamo_input" in like.meta:
            _, static, compile_id = like.meta["dynamo_input"]
            node.meta["dynamo_input"] = (ConstantSource(f"opsmath_{node.name}"), static, compile_id)
        self.captured.requires_grad.append(False)
        return node

    def size(self, node: fx.Node, dim: int):
        """``node``'s size along ``dim`` as a graph argument: an int, or (a symbolic size) a
        ``sym_size`` node computed from the tensor at run time."""
        s = node.meta["val"].shape[dim]
        if isinstance(s, int):
            return s
        n = self.call(aten.sym_size.int, (node, dim), node)
        n.meta["val"] = s
        return n

    def dropout_seed(self, p: float, on: fx.Node, like: fx.Node) -> Optional[fx.Node]:
        """The ``seed`` argument of a fused op with dropout ``p``: a fresh draw on ``on``'s device
        (``new_seed``; :func:`batch_seeds` later folds a graph's draws into one), or None without
        dropout."""
        if p <= 0:
            return None
        return self.call(new_seed, (on,), like)

    def erase_dead(self, nodes: Iterable[fx.Node]) -> None:
        """Erase ``nodes`` that have no users left, then their inputs that became dead, recursively.
        Placeholders, outputs and in-place ops are never erased, except an in-place op on a temporary
        only it uses (``scores.mul_(c)``): no one can observe that mutation."""
        work = list(nodes)
        while work:
            n = work.pop()
            if getattr(n, "_erased", False) or n.users or n.op in ("placeholder", "output"):
                continue
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                    and n.target._schema.is_mutable and not inplace_on_private_temporary(n):
                continue
            inputs = n.all_input_nodes
            self.graph.erase_node(n)
            work.extend(inputs)


def inplace_on_private_temporary(n: fx.Node) -> bool:
    """``n`` writes only its first argument, and that is a fresh intermediate (no input, attribute or
    view of one) with no user but ``n``."""
    args = n.target._schema.arguments
    writes = [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
    return writes == [0] and bool(n.args) and private_temporary(n.args[0])


def normalize(ctx: RewriteContext) -> None:
    """The graph-wide passes before matching (``normalize.py``): fills under masks that are false
    everywhere and dead code out, einsums as matmuls, ``type_as`` as a cast."""
    impossible_masks(ctx.graph)
    drop_dead_code(ctx.graph)
    einsums_as_matmuls(ctx)
    type_as_casts(ctx)


def run_patterns(captured: Captured, patterns: list, skip: Optional[set[str]] = None,
                 inductor: bool = False, inputs: Optional[list] = None, budget: bool = False,
                 priced: frozenset = frozenset()) -> RewriteContext:
    """Apply every rule (``opsmath.rewrite.rules.Rule``) to the captured graph in order, lint, recompile and
    refresh fake metadata. ``inductor``: whether Inductor compiles the result (rules may weigh it);
    ``inputs``: the real example inputs (None: rules that would add graph inputs do not); ``budget``:
    whether a memory budget is planned; ``priced``: families kept per occurrence only where they measure
    faster than Inductor (``price.py``)."""
    ctx = RewriteContext(captured, skip, inductor, inputs, budget, priced)
    ctx.families = {p.name for p in patterns} - ctx.skip   # what later rules will look for
    normalize(ctx)
    for pattern in patterns:
        pattern.apply(ctx)
        ctx.graph.lint()
    flag_unmatched(ctx, {p.name for p in patterns} - {s for s in ctx.skip if "@" not in s})
    for pattern in patterns:
        pattern.finalize(ctx)
    batch_seeds(ctx.graph)
    ctx.graph.lint()
    ctx.gm.recompile()
    _refresh_meta(ctx.gm)
    return ctx


def batch_seeds(graph: fx.Graph) -> None:
    """Fold a graph's dropout-seed draws into one per device: ``new_seed(x_i)`` at n sites becomes
    ``seeds = new_seeds(x_1, n)`` before the first site and ``seeds[i]`` (a view) at site i, so a step
    launches one random kernel for all its fused dropout ops, not one per op. Sites whose device is
    unknown (no fake value) keep their own draw."""
    by_device: dict[str, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target is new_seed:
            val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
            if isinstance(val, torch.Tensor):
                by_device.setdefault(str(val.device), []).append(n)
    for sites in by_device.values():
        if len(sites) < 2:
            continue
        first = sites[0]   # graph order: its input is defined before every site
        with graph.inserting_before(first):
            seeds = graph.create_node("call_function", new_seeds, (first.args[0], len(sites)), name="dropout_seeds")
        seeds.meta.update({k: first.meta[k] for k in ("stack_trace", "nn_module_stack") if k in first.meta})
        for i, n in enumerate(sites):
            with graph.inserting_before(n):
                one = graph.create_node("call_function", aten.select.int, (seeds, 0, i), name=f"seed_{i}")
            one.meta.update(n.meta)
            n.replace_all_uses_with(one)
            graph.erase_node(n)


def _fake_mode_of(gm: fx.GraphModule):
    """The fake mode capture traced ``gm`` under (read off its placeholders, not the ambient dynamo
    tracing context, whose shape env must not see opsmath's own fake computations)."""
    from torch._subclasses.fake_tensor import FakeTensor

    for n in gm.graph.nodes:
        if n.op == "placeholder" and isinstance(n.meta.get("val"), FakeTensor):
            return n.meta["val"].fake_mode
    return None


def _refresh_meta(gm: fx.GraphModule) -> None:
    """Give inserted nodes ``meta["val"]`` by fake-propagating the rewritten graph."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = _fake_mode_of(gm)
    if mode is None:
        return
    try:
        SymbolicSizeProp(gm, mode).propagate_dont_convert_inputs(*vals)
    except Exception as e:  # metadata is a convenience for planning/reporting, never fatal
        log.debug("opsmath: fake propagation after rewrite failed: %s", e)
    # size calls left (on inserted nodes, which have a fake value only now): the compiler that traces
    # this graph next (AOTAutograd) would turn them into ints, one guard per length
    split_size_calls(gm)


class SymbolicSizeProp(FakeTensorProp):
    """Fake propagation that keeps ``aten.size.default`` symbolic: the fake-tensor handler turns every
    size into an ``int``, which on a dynamic graph guards each length to its current value (and so
    makes dynamo recompile for every new length)."""

    def run_node(self, n: fx.Node):
        """Nodes with a fake value (from capture, or from ``RewriteContext.call`` at insertion) keep it:
        re-running an op outside the tracer that first ran it can pin symbolic sizes (a C++ kernel
        reading non-symbolic ``sizes()`` of a fake tensor guards every size to its value)."""
        if n.op == "call_function" and n.meta.get("val") is not None:
            return n.meta["val"]
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten.size.default:
            return tuple(args[0].size())
        return super().call_function(target, args, kwargs)


def module_paths(node: fx.Node) -> list[str]:
    """The qualified names (``"h.0.attn"``, as ``named_modules`` spells them) of the modules whose
    forward produced ``node``, outermost first, from dynamo's ``nn_module_stack``; [] when unknown."""
    paths = []
    for value in (node.meta.get("nn_module_stack") or {}).values():
        path = value[0] if isinstance(value, tuple) else str(value)
        path = re.sub(r"^L\['[^']*'\]\.?", "", path)                      # the frame's argument
        path = re.sub(r"\._(?:modules|parameters)\['([^']+)'\]", r".\1", path)   # older spellings
        path = re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")
        if path:
            paths.append(path)
    return paths
