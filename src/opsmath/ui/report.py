"""The graph diff report: what opsmath replaced in every captured graph, where in the user's source,
and what it left alone and why.

``print(report)`` renders with rich (plain text when not a terminal), ``report._repr_html_()`` renders
in Jupyter, ``report.to_json()`` is the form for tools.
"""
from __future__ import annotations

import json
import weakref
from collections import Counter

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from opsmath.kernels import SPECS
from opsmath.kernels.grouped_mm import LOAD_STEPS, LOADS

from opsmath.api import state_of
from opsmath.patterns.experts.regional import eager_notes
from opsmath.runtime import wgrad
from opsmath.ui.fp8_stats import fp8_rows
from opsmath.rewrite.match import Decline, Match
from opsmath.ui.rendering import Rendered

_SNIPPET_LINES = 6


def _sparkline(values: list[int], width: int) -> str:
    """``values`` resampled to ``width`` columns (max per column) as block characters, zero at the base."""
    if not values:
        return ""
    bars = "▁▂▃▄▅▆▇█"
    n = len(values)
    cols = [max(values[int(c * n / width):max(int((c + 1) * n / width), int(c * n / width) + 1)])
            for c in range(min(width, n))]
    top = max(cols) or 1
    return "".join(bars[min(len(bars) - 1, int(v / top * (len(bars) - 1) + 0.5))] for v in cols)


def _mib(n: int) -> str:
    """A size written as one word (``4.2MiB``): a wrapped line never separates a number from its unit
    (rich wraps at any whitespace, a no-break space included)."""
    return f"{n / 2**20:.1f}MiB" if n >= 2**20 else f"{n / 2**10:.0f}KiB"


def _kind(p, i: int) -> str:
    """What the plan does with segment ``i``: recomputed whole, selectively, offloaded, or only its casts."""
    return ("recomputed" if i in p.chosen else "selective" if i in p.selective
            else "offloaded" if i in p.offloaded else "weight copies")


def _kinds(p) -> str:
    """``2 recomputed, 2 selective``: how many segments the plan treats each way."""
    counts = Counter(_kind(p, i) for i in p.planned())
    return ", ".join(f"{n} {k}" for k, n in counts.items()) or "none"


class Report(Rendered):
    """Everything ``optimize`` did to one model, across its captured graph variants."""
    text_width = 80
    html_width = 100

    def __init__(self, state, model=None):
        self._model = weakref.ref(model) if model is not None else (lambda: None)
        self.model_name = state.model_name
        self.graphs = list(state.graphs)
        self.fallback_errors = list(state.fallback_errors)
        self.eager_regions = list(state.eager_regions)
        self.unoptimized_calls = state.unoptimized_calls
        self.eager_inference_calls = state.eager_inference_calls
        self.notes = list(state.notes) + [f"Inductor did not replay a graph as a CUDA graph: {m}"
                                          for m in state.cuda_graph_skips]
        self.notes += eager_notes(model) if model is not None else []   # (a module's len() may raise)
        self.notes += wgrad.report_note(self.graphs)

    @property
    def matches(self) -> list[Match]:
        return [m for g in self.graphs for m in g.matches]

    @property
    def declines(self) -> list[Decline]:
        return [d for g in self.graphs for d in g.declines]

    def count(self, pattern: str) -> int:
        return sum(m.pattern == pattern for m in self.matches)

    # ---- machine-readable ---------------------------------------------------------------------
    def expert_load(self) -> list[dict]:
        """Per rewritten MoE layer that ran: ``layer``, ``calls`` and ``tokens`` ([steps][experts], the
        tokens each expert received in each of the last ``LOAD_STEPS`` calls), ``mean`` (per expert, over
        those calls), ``imbalance`` (the busiest
        expert's mean over the experts' mean, 1.0 = balanced) and ``starved`` (experts that got no token
        in any of those calls)."""
        rows = []
        for m in self.matches:
            site = m.details.get("load_site")
            if site is None or not LOADS[site].calls:
                continue
            counts = LOADS[site].counts().double()
            per_expert = counts.mean(0)
            rows.append(dict(layer=LOADS[site].where, calls=LOADS[site].calls, tokens=counts.long().tolist(),
                             mean=per_expert.tolist(),
                             imbalance=(per_expert.max() / per_expert.mean().clamp_min(1e-9)).item(),
                             starved=[e for e in range(counts.shape[1]) if counts[:, e].sum() == 0]))
        return rows

    def fp8_underflow(self, batch=None, loss_fn=None) -> list[dict]:
        """Per weight an FP8 linear reads (``weight``: its parameter name), the share of its nonzero
        values that tensorwise e4m3 scaling flushes to zero (``underflow``), from the live weight. Given a
        ``batch`` (dict of keyword or tuple of positional arguments) also ``activation`` (e4m3) and
        ``gradient`` (e5m2, of the linear's output), from one eager step on it that leaves the model as it
        was (``fp8_stats``; the loss: ``loss_fn(output)``, else the output's ``.loss``)."""
        model = self._model()
        names = list(dict.fromkeys(m.details["weight"] for m in self.matches
                                   if m.pattern == "fp8_linear" and m.details.get("weight")))
        return fp8_rows(model, names, batch, loss_fn) if model is not None and names else []

    def plot_expert_load(self, ax=None):
        """Tokens per expert (mean over the kept steps) per rewritten MoE layer as a heatmap, each row
        titled with its imbalance; starved experts crossed out. Returns the matplotlib Axes."""
        import matplotlib.pyplot as plt
        load = self.expert_load()
        if not load:
            raise ValueError("no rewritten mixture-of-experts layer has run yet")
        width = max(len(r["mean"]) for r in load)
        grid = [r["mean"] + [float("nan")] * (width - len(r["mean"])) for r in load]
        if ax is None:
            _, ax = plt.subplots(figsize=(min(14, 2 + 0.25 * width), 1 + 0.35 * len(load)))
        image = ax.imshow(grid, aspect="auto", cmap="viridis")
        ax.figure.colorbar(image, ax=ax, label="tokens per step")
        ax.set_yticks(range(len(load)), [f"{r['layer']} ({r['imbalance']:.2f}x)" for r in load], fontsize=7)
        ax.set_xlabel("expert")
        for i, r in enumerate(load):
            for e in r["starved"]:
                ax.text(e, i, "x", ha="center", va="center", color="red")
        ax.set_title("expert load (imbalance: busiest expert / mean)", fontsize=9)
        return ax

    def to_dict(self) -> dict:
        return dict(model=self.model_name, graphs=[g.to_dict() for g in self.graphs],
                    eager_regions=[r.to_dict() for r in self.eager_regions], fallback_errors=self.fallback_errors,
                    unoptimized_calls=self.unoptimized_calls, eager_inference_calls=self.eager_inference_calls,
                    expert_load=self.expert_load(), notes=self.notes,
                    fp8_underflow=self.fp8_underflow())

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    # ---- rendering ----------------------------------------------------------------------------
    def __rich_console__(self, console, options):
        n_m, n_d = len(self.matches), len(self.declines)
        title = f"opsmath report: {self.model_name}: {len(self.graphs)} graph(s), {n_m} rewrite(s), {n_d} declined"
        yield Text(title, style="bold")
        for note in self.notes:
            yield Text(note, style="dim")
        flushed = self.fp8_underflow()
        if flushed:
            worst = max(flushed, key=lambda r: r["underflow"])
            yield Text(f"FP8 weights flushed to zero by e4m3 scaling: mean "
                       f"{sum(r['underflow'] for r in flushed) / len(flushed):.3%}, most {worst['underflow']:.3%} "
                       f"({worst['weight']}), over {len(flushed)} weights", style="dim")
        if not self.graphs and self.unoptimized_calls and self.fallback_errors:
            yield Text("nothing rewritten: every graph fell back (below)", style="red")
        elif not self.graphs and self.unoptimized_calls:
            yield Text("nothing captured: dynamo found no graph in the forward it could hand to opsmath (its graph "
                       "breaks are below); the model runs as plain PyTorch, as it would under torch.compile",
                       style="red")
        elif not self.graphs:
            yield Text("nothing captured yet: call the optimized model once", style="yellow")
        for g in self.graphs:
            yield self._graph_panel(g)
        if self.eager_regions:
            yield self._eager_table()
        load = self.expert_load()
        if load:
            yield self._load_table(load)
        for r in load:
            if r["starved"]:
                yield Text(f"warning: in {r['layer']}, expert(s) {r['starved']} got no tokens in the last "
                           f"{len(r['tokens'])} steps", style="red")
        for err in self.fallback_errors:
            yield Text(f"fallback: {err}", style="red")
        if self.unoptimized_calls:
            yield Text(f"{self.unoptimized_calls} call(s) ran none of opsmath's graphs (dynamo's recompile limit, "
                       "or nothing capturable in the frame): they ran as plain PyTorch", style="red")
        if self.eager_inference_calls:
            yield Text(f"{self.eager_inference_calls} no-grad call(s) at inputs no training call had (generate, "
                       "evaluation at other sizes) ran eagerly: no capture per shape")

    def _graph_panel(self, g) -> Panel:
        parts = []
        total_b, total_a = sum(g.before_ops.values()), sum(g.after_ops.values())
        head = f"{'train' if g.training else 'eval'} | ran {g.calls}x | ops {total_b}->{total_a}"
        if g.launches[0] is not None:
            head += f" | fwd launches {g.launches[0]}->{g.launches[1]}"
        if g.saved_bytes[0] is not None and g.saved_bytes[1] is not None:
            head += f" | saved for bwd {_mib(g.saved_bytes[0])}->{_mib(g.saved_bytes[1])}"
        parts.append(Text(head + f" | {g.capture_seconds:.2f}s"))
        if g.dynamic:
            shapes = ", ".join(str(tuple(s)) for s in g.input_shapes if isinstance(s, tuple) and s)[:120]
            parts.append(Text(f"dynamic sizes (one graph for every value; seen first: {shapes})"
                              + (f"; not applied, they need static sizes: {', '.join(g.static_only)}"
                                 if g.static_only else ""), style="dim"))
        if g.inductor:
            parts.append(Text("compiled by Inductor" + (" for CUDA-graph replay" if g.cuda_graphs else "")
                              + (f"; left to it: {', '.join(g.left_to_inductor)}" if g.left_to_inductor else ""),
                              style="dim"))
        before, after = g.saved_bytes
        if before is not None and after is not None and after > before:
            parts.append(self._saved_more(g.matches))
        if g.left_on_gpu:
            parts.append(Text(f"on a CUDA GPU (Inductor on) these are left to Inductor: {', '.join(g.left_on_gpu)}",
                              style="dim"))
        if g.matches:
            groups = self._distinct(g.matches)
            parts.append(self._rewrites(groups))
            parts.extend(self._snippet(ms[0]) for ms in groups.values())  # one snippet per distinct rewrite
        if g.declines:
            t = Table(show_header=True, header_style="bold", box=None, padding=(0, 1))
            t.add_column("declined", style="yellow", no_wrap=True)
            t.add_column("source", style="cyan", no_wrap=True)
            t.add_column("why", overflow="fold")
            for d in g.declines:
                t.add_row(d.pattern, d.location, d.reason)
            parts.append(t)
        if g.plan is not None:
            parts.append(self._plan_text(g.plan))
        changed = sorted(set(g.before_ops) | set(g.after_ops),
                         key=lambda k: -abs(g.before_ops.get(k, 0) - g.after_ops.get(k, 0)))
        diffs = [f"{k} {g.before_ops.get(k, 0)}->{g.after_ops.get(k, 0)}" for k in changed
                 if g.before_ops.get(k, 0) != g.after_ops.get(k, 0)]
        if diffs:
            parts.append(Text("op diff: " + ", ".join(diffs[:8]) + (" ..." if len(diffs) > 8 else ""),
                              style="dim"))
        return Panel(Group(*parts), title=f"graph {g.index}", title_align="left")

    def _eager_table(self) -> Table:
        """What runs as written (autograd Functions, hooks, graph breaks, checkpoint calls) and why."""
        t = Table(title="kept as written (runs outside opsmath's graphs), or handed to the plan",
                  title_justify="left",
                  show_header=True, header_style="bold", box=None, padding=(0, 1))
        t.add_column("what", style="yellow", no_wrap=True)
        t.add_column("source", style="cyan", no_wrap=True)
        t.add_column("how", overflow="fold")
        for r in self.eager_regions:
            t.add_row(r.kind, r.location, r.reason + (f": {r.code}" if r.code else ""))
        return t

    @staticmethod
    def _load_table(load: list[dict]) -> Table:
        t = Table(title=f"expert load (tokens per expert, last {LOAD_STEPS} steps at most)", title_justify="left",
                  show_header=True, header_style="bold", box=None, padding=(0, 1))
        for col in ("layer", "steps", "per expert (mean)", "min", "max", "imbalance"):
            t.add_column(col, no_wrap=True)
        for r in load:
            mean = r["mean"]
            t.add_row(r["layer"], str(len(r["tokens"])), _sparkline([round(x) for x in mean], 16),
                      f"{min(mean):.0f}", f"{max(mean):.0f}", f"{r['imbalance']:.2f}x")
        return t

    @staticmethod
    def _saved_more(matches) -> Text:
        """Why a graph keeps more for backward after rewriting: the families whose replacements save more
        than the nodes they replaced, with what their op saves (the op spec's ``saves``)."""
        grown: dict = {}
        for m in matches:
            if m.saved_delta is not None and m.saved_delta > 0:
                grown.setdefault(m.pattern, []).append(m.saved_delta)
        if not grown:
            return Text("saved for bwd grows outside the rewritten nodes (no rewrite keeps more itself)",
                        style="dim")
        why = []
        for family, deltas in sorted(grown.items(), key=lambda kv: -sum(kv[1])):
            spec = SPECS.get(family)
            count = f" x{len(deltas)}" if len(deltas) > 1 else ""
            keeps = f" (keeps {spec.saves})" if spec is not None and spec.saves else ""
            why.append(f"{family}{count} +{_mib(sum(deltas))}{keeps}")
        return Text("saved for bwd grows: " + "; ".join(why), style="dim")

    @staticmethod
    def _distinct(matches) -> dict:
        """Matches grouped by (pattern, source line, replacement): every layer of a model repeats one."""
        groups: dict = {}
        for m in matches:
            groups.setdefault((m.pattern, m.location, m.replacement), []).append(m)
        return groups

    @staticmethod
    def _rewrites(groups: dict) -> Text:
        """One line per distinct rewrite (``_distinct``) with how often it occurs: ``attention x12
        examples.py:37 6 nodes -> opsmath::attention(...)``. Plain text that wraps at spaces, so no name
        or number is cut."""
        t = Text()
        for (pattern, location, replacement), ms in groups.items():
            t.append(f"{pattern}", style="green")
            t.append(f" x{len(ms)}" if len(ms) > 1 else "")
            t.append(f"  {location}", style="cyan")
            t.append(f"  {len(ms[0].nodes)} nodes ->  {replacement}\n")
        t.rstrip()
        return t

    @staticmethod
    def _plan_text(p) -> Text:
        t = Text()
        as_bytes, share = p.budget_both_units()
        beyond = (f" + held back for step 1's error, not yet measured {_mib(p.first_margin)}" if p.first_margin
                  else f" + measured beyond the model {_mib(p.excess)}" if p.excess else "")
        why = "the gradients of the tensors returned beside the loss" if p.returned >= p.head_excess > 0 \
            else "the loss's workspace"
        at_end = f"; {_mib(p.head_excess)} more at the end of the forward ({why})" if p.head_excess else ""
        if p.timed:   # a byte budget, planned against the gradients' timing
            how = (f" on the step's timeline (resident {_mib(p.resident - sum(p.grads))}, kept {_mib(p.kept)}, "
                   f"gradients {_mib(sum(p.grads))} as backward allocates them{beyond}{at_end})")
        else:
            how = (f" = resident {_mib(p.resident)} + kept {_mib(p.kept)} + recompute {_mib(p.transient)}{beyond}{at_end}"
                   + (f" (expected {_mib(p.expected_peak)}: gradients arrive as activations leave)"
                      if p.expected_peak else ""))
        t.append(f"memory plan: budget {p.budget} (= {_mib(as_bytes)}, {share:.2f} of activations) | predicted "
                 f"peak {_mib(p.predicted_peak)}{how}\n", style="bold")
        said = [f"resident counts {_mib(p.to_come)} of optimizer state that the first step allocates"] \
            if p.to_come else []
        said += [x for x in (p.optimizer, p.allocator) if x]
        if said:
            t.append("; ".join(said) + "\n")
        listed = p.planned()
        t.append(f"activations (as {p.estimated_by} saves them) {_mib(p.unconstrained)} -> {_mib(p.kept)}; "
                 f"{len(listed)} of {len(p.segments)} segments planned ({_kinds(p)}; "
                 f"{'measured' if p.measured_ops else 'modelled'} +{p.recompute_seconds * 1e3:.2f} ms"
                 f"{' with the host copies' if p.offloaded else ''}); planned in "
                 f"{p.planning_seconds:.2f}s", style="magenta")
        if p.selective:
            g, tensors = len(p.gemms_recomputed), len(p.tensors)
            free = sum(1 for i in p.selective if p.segments[i].only is not None) - tensors
            t.append(f"\n{len(p.selective)} runs recompute only their cheap ops, keeping their GEMMs"
                     + (f" ({g} of them their GEMMs too, keeping attention)" if g else "")
                     + (f" ({free} of them only those computed from kept tensors)" if free else "")
                     + (f" ({tensors} of them the GEMMs that free the most bytes per ms too)" if tensors else ""),
                     style="magenta")
        if p.casts:
            t.append(f"\n{len(p.casts)} segments recompute their weights' low-precision copies in backward "
                     f"({_mib(sum(p.segments[i].casts for i in p.casts))} not kept)", style="magenta")
        if p.offloaded:
            t.append(f"\n{len(p.offloaded)} segments keep their tensors in host memory ({_mib(p.offloaded_bytes)} "
                     f"each way over the host link, {p.link / 1e9:.0f} GB/s measured, copied on a side stream "
                     "under the compute; in the modelled cost)", style="magenta")
        if p.user_regions:
            t.append(f"\nsegments: the user's {p.user_regions} checkpoint regions as candidates, "
                     + ("kept: the plan recomputes the chosen ones" if p.segmentation == "user" else
                        "replaced by opsmath's own cut points (cheaper, or the only feasible)"))
        t.append("\nmemory over the step (predicted; forward, then backward): ")
        t.append(_sparkline([b for _, _, b in p.timeline()], 48), style="cyan")
        if p.measured_peak is not None:
            over = p.measured_peak > as_bytes
            t.append(f"\nmeasured peak {_mib(p.measured_peak)} (max_memory_allocated when the graph ran again), "
                     + (f"over the budget's {_mib(as_bytes)}" if over else f"within the budget's {_mib(as_bytes)}"),
                     style="red" if over else None)
        if p.replanned:
            t.append(f"\nre-planned after the first steps: {p.replanned}", style="yellow")
        if p.note:
            t.append(f"\n{p.note}", style="yellow")
        for i in listed[:6]:
            s, where = p.segments[i], p.offloaded.get(i)
            what = (f"keeps {_mib(s.inputs)}" + ((" (attention outputs among them)" if i in p.gemms_recomputed else
                                                  " (GEMM outputs among them)") if i in p.selective else "")
                    if where is None else "in host memory" if where == "kept"
                    else f"its inputs ({_mib(s.inputs)}) in host memory")
            t.append(f"\n  segment {i} ({_kind(p, i)}): {p.ops.get(i) or f'nodes {s.start}-{s.end}'}, "
                     f"saves {_mib(s.saved)}, {what}"
                     + (f", recompute {s.cost * 1e3:.3f} ms" if i in p.chosen or i in p.selective else "")
                     + (f", weight copies {_mib(s.casts)} recomputed" if i in p.casts else ""))
        if len(listed) > 6:
            t.append(f"\n  ... {len(listed) - 6} more")
        return t

    @staticmethod
    def _snippet(m: Match) -> Text:
        t = Text()
        t.append(f"e.g. {m.location}: {m.code}\n", style="bold")
        lines = m.before[:_SNIPPET_LINES]
        for ln in lines:
            t.append(f"- {ln}\n", style="red")
        if len(m.before) > len(lines):
            t.append(f"- ... {len(m.before) - len(lines)} more\n", style="red")
        t.append(f"+ {m.replacement}", style="green")
        return t

    def __repr__(self) -> str:
        return f"<opsmath.Report {self.model_name}: {len(self.matches)} rewrites in {len(self.graphs)} graphs>"


def report(optimized) -> Report:
    """The :class:`Report` of a module returned by ``opsmath.optimize``."""
    return Report(state_of(optimized), optimized)
