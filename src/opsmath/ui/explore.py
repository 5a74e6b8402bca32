"""``opsmath.explore``: look at every candidate rewrite of a model before committing to it.

    ex = opsmath.explore(model, *example_inputs)
    ex                      # table of candidates (Jupyter: HTML)
    ex.skip(2); ex.draw(0)  # leave candidate 2 alone; picture of candidate 0's subgraph
    opt = ex.emit()         # an optimized copy with the chosen rewrites
    print(ex.compare(opt))  # opsmath.verify against the eager model

Exploration captures a deep copy of the model (forward only, in the model's current train/eval mode);
the model itself is never modified.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from rich.table import Table

from opsmath.api import optimize
from opsmath.ui.rendering import Rendered
from opsmath.ui.report import Report, report
from opsmath.ui.verify import VerifyResult, verify


@dataclass
class Candidate:
    id: int
    graph: int
    pattern: str
    location: str
    code: str
    replacement: str
    key: str               # "pattern@anchor", what optimize(skip=...) takes
    nodes: list
    enabled: bool = True


class Exploration(Rendered):
    def __init__(self, model: torch.nn.Module, *inputs):
        self.model = model
        self.inputs = inputs
        probe = optimize(copy.deepcopy(model))
        probe(*inputs)
        self.report: Report = report(probe)
        self.candidates = [
            Candidate(i, g.index, m.pattern, m.location, m.code, m.replacement, m.key, m.nodes)
            for i, (g, m) in enumerate((g, m) for g in self.report.graphs for m in g.matches)]
        self.declines = self.report.declines

    # ---- choosing ------------------------------------------------------------------------------
    def skip(self, *ids: int) -> "Exploration":
        for i in ids:
            self.candidates[i].enabled = False
        return self

    def enable(self, *ids: int) -> "Exploration":
        for i in ids:
            self.candidates[i].enabled = True
        return self

    def only(self, pattern: str) -> "Exploration":
        """Enable the candidates of one pattern family, skip the rest."""
        for c in self.candidates:
            c.enabled = c.pattern == pattern
        return self

    @property
    def skipped(self) -> list[str]:
        return sorted({c.key for c in self.candidates if not c.enabled})

    def emit(self) -> torch.nn.Module:
        """An optimized deep copy of the model with the enabled candidates rewritten."""
        return optimize(copy.deepcopy(self.model), skip=self.skipped)

    def compare(self, emitted: torch.nn.Module | None = None, **verify_kw) -> VerifyResult:
        """``opsmath.verify`` of the emitted model (``emit()`` if not given) against the eager model."""
        return verify(self.model, emitted if emitted is not None else self.emit(), *self.inputs, **verify_kw)

    # ---- looking -------------------------------------------------------------------------------
    def draw(self, candidate: int | None = None, graph: int = 0, ax=None, hops: int = 1):
        """Draw the captured graph (or, given ``candidate``, its subgraph and ``hops`` neighbours) with
        enabled rewrites in red, skipped ones in grey. Returns the matplotlib Axes."""
        import matplotlib.pyplot as plt
        import networkx as nx

        if candidate is not None:
            graph = self.candidates[candidate].graph
        g = self.report.graphs[graph].before_nx
        color = {}
        for c in self.candidates:
            if c.graph == graph:
                for n in c.nodes:
                    color[n] = "tab:red" if c.enabled else "tab:gray"
        if candidate is not None:   # nodes the pre-matching passes inserted (a type_as read as a cast) are not drawn
            keep = {n for n in self.candidates[candidate].nodes if n in g}
            for _ in range(hops):
                keep |= {m for n in keep for m in (*g.predecessors(n), *g.successors(n))}
            g = g.subgraph(keep)
        pos = {}
        for depth, layer in enumerate(nx.topological_generations(g)):
            for i, n in enumerate(sorted(layer)):
                pos[n] = (i - len(layer) / 2, -depth)
        if ax is None:
            height = max(3, min(40, 0.45 * (1 - min(y for _, y in pos.values()))))
            _, ax = plt.subplots(figsize=(8, height))
        nx.draw_networkx(g, pos, ax=ax, labels={n: g.nodes[n]["label"] for n in g}, font_size=7,
                         node_size=220, node_color=[color.get(n, "tab:blue") for n in g], alpha=0.85,
                         arrowsize=8)
        ax.set_axis_off()
        title = f"graph {graph}" if candidate is None else \
            f"candidate {candidate}: {self.candidates[candidate].pattern} at {self.candidates[candidate].location}"
        ax.set_title(title + " (red: rewritten, grey: skipped)", fontsize=9)
        return ax

    def plot_expert_load(self, ax=None):
        """Tokens per expert of each rewritten MoE layer in the exploration's run (``Report.plot_expert_load``)."""
        return self.report.plot_expert_load(ax)

    def __rich_console__(self, console, options):
        t = Table(title=f"opsmath.explore: {len(self.candidates)} candidates, {len(self.declines)} declined",
                  box=None, padding=(0, 1))
        for col in ("id", "on", "pattern", "source", "replaced by"):
            t.add_column(col, overflow="fold")
        for c in self.candidates:
            t.add_row(str(c.id), "yes" if c.enabled else "no", c.pattern, c.location, c.replacement)
        yield t
        for d in self.declines:
            yield f"declined {d.pattern} at {d.location}: {d.reason}"



def explore(model: torch.nn.Module, *example_inputs) -> Exploration:
    """Capture ``model`` on ``example_inputs`` and list every rewrite opsmath would make."""
    return Exploration(model, *example_inputs)
