"""Families written as patterns: a plain function of tensors, traced once to ATen, matched at the node
that computes its result, with either operand order of commutative ops.

This is what torch's pattern matcher does (``register_replacement``: a search function, a replacement,
an ``extra_check``), kept in opsmath's driver: each occurrence goes through ``ctx.offer`` like every
other family's, so the user's skips, the report's declines and dead-code removal stay shared.

A ``PatternRule`` declares

- ``patterns``: functions ``f(*tensors) -> tensor`` in torch ops, e.g. ``lambda a, b: F.silu(a) * b``.
  Each is traced once with ``make_fx`` on small example tensors; its placeholders are named after the
  function's parameters. ``add`` / ``mul`` match either operand order, so ``b * silu(a)`` needs no second
  spelling. Python numbers in a pattern must equal the graph's (floats to 1e-6 relative).
- ``check(ctx, m)``: ``True`` (take it), a ``str`` (this family's occurrence, left alone: the reason) or
  ``None`` (not this family's, e.g. an integer dtype);
- ``replacement(ctx, m)``: ``(op, args)``, the fused op and its arguments built from ``m.inputs``;
- ``describe(m)``: ``(text, details)`` for the report.

An intermediate of the match that something outside it also reads must keep existing, which the fused op
would not provide: such an occurrence is declined with ``read_elsewhere`` (or a generic reason).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from opsmath.rewrite.canonicalize import aten
from opsmath.rewrite.match import RewriteContext, node_line
from opsmath.rewrite.rules import Rule

COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}


@dataclass
class PatternMatch:
    anchor: fx.Node                                   # the graph node computing the pattern's result
    inputs: dict[str, fx.Node]                        # pattern parameter name -> graph node
    nodes: list[fx.Node] = field(default_factory=list)   # matched graph nodes, pattern order, anchor last

    def __getitem__(self, name: str) -> fx.Node:
        return self.inputs[name]


def trace_pattern(fn: Callable) -> fx.GraphModule:
    """``fn`` traced to ATen on 2 x 8 float tensors, its placeholders named after its parameters."""
    names = list(inspect.signature(fn).parameters)
    gm = make_fx(fn)(*[torch.randn(2, 8) for _ in names])
    for node, name in zip(gm.graph.find_nodes(op="placeholder"), names):
        node._rename(name)
        node.target = name
    gm.recompile()
    return gm


def find(pattern: fx.GraphModule, node: fx.Node) -> Optional[PatternMatch]:
    """The match of ``pattern`` whose result is ``node``, or None."""
    out = pattern.graph.find_nodes(op="output")[0].args[0]
    for env in _matches(out, node, {}):
        inputs = {p.target: n for p, n in env.items() if p.op == "placeholder"}
        nodes = [env[p] for p in pattern.graph.nodes if p.op == "call_function"]
        return PatternMatch(node, inputs, nodes)
    return None


def _matches(p: fx.Node, n, env: dict) -> Iterator[dict]:
    """Every extension of ``env`` (pattern node -> graph node) under which ``p`` computes ``n``."""
    if not isinstance(n, fx.Node):
        return
    if p in env:
        if env[p] is n:
            yield env
        return
    if p.op == "placeholder":
        if not any(q.op != "placeholder" and v is n for q, v in env.items()):   # an input, not an intermediate
            yield {**env, p: n}
        return
    if n.op != "call_function" or n.target != p.target or set(n.kwargs) != set(p.kwargs) \
            or not all(_same(p.kwargs[k], n.kwargs[k]) for k in p.kwargs):
        return
    orders = [n.args]
    if p.target in COMMUTATIVE and len(n.args) == 2:
        orders.append(n.args[::-1])
    for args in orders:
        if len(args) == len(p.args):
            yield from _match_args(list(zip(p.args, args)), {**env, p: n})


def _match_args(pairs: list, env: dict) -> Iterator[dict]:
    if not pairs:
        yield env
        return
    (pa, na), rest = pairs[0], pairs[1:]
    if isinstance(pa, fx.Node):
        for e in _matches(pa, na, env):
            yield from _match_args(rest, e)
    elif _same(pa, na):
        yield from _match_args(rest, env)


def _same(a, b) -> bool:
    """Pattern literal ``a`` equals graph literal ``b`` (floats to 1e-6 relative)."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class PatternRule(Rule):
    """A rule given as patterns (module doc); ``anchors`` are the patterns' result ops."""
    patterns: tuple[Callable, ...] = ()
    read_elsewhere: str = ""

    def __init__(self):
        self.traced = [trace_pattern(fn) for fn in self.patterns]
        self.anchors = tuple(dict.fromkeys(
            gm.graph.find_nodes(op="output")[0].args[0].target for gm in self.traced))

    def check(self, ctx: RewriteContext, m: PatternMatch):
        return True

    def replacement(self, ctx: RewriteContext, m: PatternMatch) -> tuple:
        raise NotImplementedError

    def describe(self, m: PatternMatch) -> tuple[str, dict]:
        return f"{self.name}", {}

    def match(self, ctx: RewriteContext, node: fx.Node):
        for gm in self.traced:
            m = find(gm, node)
            if m is None:
                continue
            verdict = self.check(ctx, m)
            if verdict is None:
                return None
            inside = set(m.nodes)
            shared = [x for x in m.nodes if x is not node and any(u not in inside for u in x.users)]
            if shared:
                return self.read_elsewhere or f"{shared[0].name} is also read elsewhere, so it must exist"
            return verdict if isinstance(verdict, str) else m
        return None

    def emit(self, ctx: RewriteContext, node: fx.Node, m: PatternMatch) -> None:
        op, args = self.replacement(ctx, m)
        before = [node_line(x) for x in m.nodes]
        with ctx.graph.inserting_before(node):
            y = ctx.call(op, args, node)
        node.replace_all_uses_with(y)
        ctx.erase_dead([node])
        text, details = self.describe(m)
        ctx.replaced(self.name, node, m.nodes, text, before, **details)
