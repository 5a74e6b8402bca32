"""Rewrite rules: one per family, registered once, ordered by their declared constraints.

A family's pattern file (``patterns/x.py``) defines a ``Rule`` subclass and registers one instance with
``register_rule``. The driver (``Rule.apply``) owns everything the families share: it finds the anchor
nodes (``anchors``: the graph targets an occurrence hangs on, visited in graph order), asks the rule's
pure ``match(ctx, node)`` about each, and hands the answer to ``RewriteContext.offer``, which applies the
user's skips, records declines for the report, or calls ``emit``. Dead-code removal and dropout seeds
are the context's (``ctx.erase_dead``, ``ctx.dropout_seed``).

``match`` returns ``None`` (not this family's occurrence), a ``str`` (this family's, left alone: the
reason, shown in the report) or a plan (anything else) that ``emit(ctx, node, plan)`` turns into the
replacement. ``anchor_for(node, plan)`` names the node the occurrence is reported and skipped under
when that is not the anchor itself.

``after`` lists families whose rewrites must come first (e.g. ``cross_entropy`` takes only the losses
``linear_cross_entropy`` left). ``ordered()`` sorts the registered rules topologically by it, ties in
registration order. ``dynamic_shapes`` says the rule is sound on graphs with symbolic sizes;
``data_dependent_shapes`` that it is offered anchors whose sizes are known only at run time (the
unbacked sizes of ``torch.where(mask)``, ``nonzero``): other rules never see those.
``opt_in`` names an ``optimize`` keyword (``fp8``) without which the rule is not applied by default.
``finalize(ctx)`` runs once all rules have applied (the attention family chooses its backends there).
"""
from __future__ import annotations

from typing import Any, Optional

import networkx as nx
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from opsmath.rewrite.match import RewriteContext


class Rule:
    name: str = ""
    anchors: tuple = ()
    after: tuple[str, ...] = ()
    dynamic_shapes: bool = False
    data_dependent_shapes: bool = False
    opt_in: Optional[str] = None      # an ``optimize`` keyword that must be set for the rule to apply

    def match(self, ctx: RewriteContext, node: fx.Node) -> Any:
        raise NotImplementedError

    def emit(self, ctx: RewriteContext, node: fx.Node, plan: Any) -> None:
        raise NotImplementedError

    def anchor_for(self, node: fx.Node, plan: Any) -> fx.Node:
        return node

    def prepare(self, model) -> list[str]:
        """Called once by ``optimize`` before anything is captured, for a choice the family makes on the
        module itself (a library's implementation switch with the same math); what it changed, for
        the report."""
        return []

    def finalize(self, ctx: RewriteContext) -> None:
        """A pass after every rule has matched and emitted (e.g. attention's backend choice, which
        measures kernels): what must not run while matching, so that matching stays pure."""

    def apply(self, ctx: RewriteContext) -> None:
        for node in anchored(ctx.graph, self.anchors):
            if getattr(node, "_erased", False):
                continue
            if not self.data_dependent_shapes and data_dependent(node):
                continue
            plan = self.match(ctx, node)
            if plan is not None:
                ctx.offer(self.name, self.anchor_for(node, plan), plan,
                          lambda node=node, plan=plan: self.emit(ctx, node, plan))


def data_dependent(node: fx.Node) -> bool:
    """Whether ``node``'s value or one of its inputs' has a size known only at run time."""
    return any(free_unbacked_symbols(n.meta.get("val")) for n in (node, *node.all_input_nodes))


def anchored(graph: fx.Graph, targets) -> list[fx.Node]:
    """The ``call_function`` nodes of ``graph`` whose target is one of ``targets``, in graph order
    (a list: rules rewrite the graph while the driver walks it)."""
    found = {n for t in targets for n in graph.find_nodes(op="call_function", target=t)}
    return [n for n in graph.nodes if n in found]


RULES: dict[str, Rule] = {}


def register_rule(rule: Rule) -> Rule:
    if not rule.name or not rule.anchors:
        raise ValueError(f"rule {type(rule).__name__} needs a name and anchor targets")
    if rule.name in RULES and type(RULES[rule.name]) is not type(rule):
        raise ValueError(f"rule {rule.name!r} registered twice")
    RULES[rule.name] = rule
    return rule


def ordered(rules: Optional[dict[str, Rule]] = None) -> list[Rule]:
    """The rules in an order that honours every ``after`` (ties: registration order)."""
    rules = RULES if rules is None else rules
    index = {name: i for i, name in enumerate(rules)}
    g = nx.DiGraph()
    g.add_nodes_from(rules)
    for name, rule in rules.items():
        for first in rule.after:
            if first not in rules:
                raise ValueError(f"rule {name!r} runs after {first!r}, which is not registered")
            g.add_edge(first, name)
    try:
        return [rules[n] for n in nx.lexicographical_topological_sort(g, key=index.__getitem__)]
    except nx.NetworkXUnfeasible:
        raise ValueError(f"rules' 'after' constraints form a cycle: {nx.find_cycle(g)}") from None
