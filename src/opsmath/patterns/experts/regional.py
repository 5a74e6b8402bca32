"""Expert loops traced once per module class, not once per layer.

Dynamo traces a loop over experts one ``torch.where`` at a time, each a data-dependent (unbacked) size,
and lowering traces it again: about 0.1 s per expert per layer on a 2-core CPU (a 64-expert, 8-layer
model: 55 s of tracing before its first step, where ``torch.compile``, which breaks the graph at every
``torch.where``, reuses its pieces across experts and layers). Where a model repeats such a module
(``REGIONAL_EXPERTS`` experts over all its instances, or more), each instance's call becomes a graph
break of its own and its ``forward`` a frame of its own: dynamo compiles that frame once, for the first
instance, and every other instance of the class runs the same compiled graph (parameters are graph
inputs, as in torch's regional compilation). The loop is rewritten once.

The cost: the graph is broken around each such module (the blocks' code before and after it runs as
graphs of their own, also compiled once and reused), so Inductor fuses nothing across the boundary, and
each boundary costs the host a graph call. Below the threshold the whole model stays one graph. The
report's notes name the modules; their expert-load view pools every instance (one graph).
"""
from __future__ import annotations

from collections import defaultdict

import torch

REGIONAL_EXPERTS = 128   # experts x instances from which a module's loop is traced once for all instances


def expert_lists(module: torch.nn.Module) -> int:
    """Experts ``module`` holds as modules, in an ``nn.ModuleList`` child named ``*expert*`` (0: none)."""
    return max([len(child) for name, child in module.named_children()
                if isinstance(child, torch.nn.ModuleList) and len(child) > 1 and "expert" in name.lower()],
               default=0)


ACTIVE: list[str] = []    # the label of the modules whose graph runs (and may be captured) now


def _own_graph(own: "OwnGraph", *args, **kwargs):
    ACTIVE.append(own.label)
    try:
        return type(own.module).forward(own.module, *args, **kwargs)
    finally:
        ACTIVE.pop()


# skipped by dynamo (a graph break in the caller), while the frame it calls, the module's ``forward``, is
# compiled by the same ``torch.compile`` as the caller's: one cache entry serves every instance
_own_graph = torch._dynamo.disable(_own_graph, recursive=False)


class OwnGraph:
    """An instance's ``forward`` (``module.forward``), the class's ``forward`` behind a graph break;
    ``label`` names the modules that share its graph, for the report while it is captured. Copies and
    pickles of the module carry it bound to themselves (``module`` is an attribute)."""

    def __init__(self, module: torch.nn.Module, label: str):
        self.module, self.label = module, label

    def __call__(self, *args, **kwargs):
        return _own_graph(self, *args, **kwargs)


def trace_once(model: torch.nn.Module) -> list[str]:
    """Give each repeated expert-loop module of ``model`` its own graph (``OwnGraph``) where its class has
    ``REGIONAL_EXPERTS`` experts in all; the report's notes for those it did."""
    by_class = defaultdict(list)
    for name, m in model.named_modules():
        if expert_lists(m) and "forward" not in m.__dict__:    # a forward set on the instance stays
            by_class[type(m)].append((name, m))
    notes = []
    for cls, found in by_class.items():
        experts = sum(expert_lists(m) for _, m in found)
        if len(found) < 2 or experts < REGIONAL_EXPERTS:
            continue
        names = [n for n, _ in found]
        label = f"{names[0]} ... {names[-1]}"
        for _, m in found:
            m.forward = OwnGraph(m, label)
        notes.append(f"experts: {len(found)} {cls.__name__} modules ({label}, {experts} experts "
                     f"in all) each run as a graph of their own, traced and rewritten once for all of them: a "
                     f"loop over experts traces one data-dependent size per expert; the graph breaks around "
                     f"them (their expert-load view pools all {len(found)})")
    return notes
