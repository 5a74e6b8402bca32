"""``opsmath.profile``: what the rewrite changes in a training step, from ``torch.profiler``.

For the eager model and the optimized one, the same fwd+bwd step on the same inputs: device kernels
per step (CUDA) or dispatched top-level ops per step (CPU), time per op class, step time, and peak
memory (CUDA: ``torch.cuda.max_memory_allocated``).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from rich.table import Table

from opsmath.kernels import SPECS

from opsmath.ui.rendering import Rendered
from opsmath.ui.verify import _scalar

# op class by substring of the profiler name (CUDA kernel names or aten/opsmath op names): the fused
# ops' own classes (their op specs' ``profile``), then generic ones
_CLASSES = [spec.profile for spec in SPECS.values() if spec.profile] + [
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "mm", "linear", "matmul")),
    ("elementwise", ("elementwise", "vectorized", "add", "mul", "div", "dropout", "where", "masked_fill",
                     "fill", "copy", "cat", "gelu", "silu", "tanh", "pow", "mean", "sum", "reduce")),
]


def op_class(name: str) -> str:
    low = name.lower()
    for cls, keys in _CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


@dataclass
class ProfileRow:
    name: str
    launches_per_step: float
    ms_per_step: float
    ms_by_class: dict = field(default_factory=dict)
    peak_bytes: int | None = None


@dataclass
class ProfileResult(Rendered):
    text_width = html_width = 120
    device: str
    rows: list[ProfileRow]

    def __rich_console__(self, console, options):
        unit = "kernels" if self.device == "cuda" else "ops"
        classes = [c for c, _ in _CLASSES] + ["other"]
        t = Table(title=f"opsmath.profile ({self.device}, per fwd+bwd step)", box=None, padding=(0, 1))
        t.add_column("model")
        t.add_column(unit, justify="right")
        t.add_column("step ms", justify="right")
        for c in classes:
            t.add_column(f"{c} ms", justify="right")
        t.add_column("peak MiB", justify="right")
        for r in self.rows:
            t.add_row(r.name, f"{r.launches_per_step:.0f}", f"{r.ms_per_step:.2f}",
                      *[f"{r.ms_by_class.get(c, 0.0):.2f}" for c in classes],
                      "-" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.0f}")
        yield t

    def plot(self, ax=None):
        """Stacked bars of time per op class for each model; returns the Axes."""
        import matplotlib.pyplot as plt
        if ax is None:
            _, ax = plt.subplots(figsize=(6, 3.5))
        bottom = [0.0] * len(self.rows)
        for c in [c for c, _ in _CLASSES] + ["other"]:
            vals = [r.ms_by_class.get(c, 0.0) for r in self.rows]
            ax.bar([r.name for r in self.rows], vals, bottom=bottom, label=c)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("ms per step (profiled)")
        ax.legend(fontsize=7)
        return ax


def _is_op(e) -> bool:
    return e.name.startswith(("aten::", "opsmath::"))


def _has_op_ancestor(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if _is_op(p):
            return True
        p = p.cpu_parent
    return False


def _step(model, inputs, weights):
    loss, _ = _scalar(model(*inputs), weights)
    loss.backward()
    model.zero_grad(set_to_none=True)


def profile(model: torch.nn.Module, optimized: torch.nn.Module, *inputs, steps: int = 3) -> ProfileResult:
    """Profile ``steps`` fwd+bwd steps of the eager ``model`` and of ``optimized`` on ``inputs``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs)
    rows, weights = [], {}
    for name, m in (("eager", model), ("opsmath", optimized)):
        _step(m, inputs, weights)  # warm-up: capture, compile, autotune
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        t0 = time.perf_counter()
        with torch_profile(activities=acts) as prof:
            for _ in range(steps):
                _step(m, inputs, weights)
            if cuda:
                torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
        by_class: dict = defaultdict(float)
        launches = 0
        for e in prof.events():
            if cuda:
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    launches += 1
                    by_class[op_class(e.name)] += e.device_time_total / 1e3 / steps
            elif _is_op(e) and not _has_op_ancestor(e):  # outermost operator calls
                launches += 1
                by_class[op_class(e.name)] += e.cpu_time_total / 1e3 / steps
        peak = torch.cuda.max_memory_allocated() if cuda else None
        rows.append(ProfileRow(name, launches / steps, wall, dict(by_class), peak))
    return ProfileResult("cuda" if cuda else "cpu", rows)
