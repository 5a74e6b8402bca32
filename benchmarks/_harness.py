"""Shared benchmark plumbing: environment record, CUDA-event timing (median), peak memory, JSON out, and
the training-step variants' warm-up and interleaved timed rounds (``Stepper``, ``interleave``).

Every benchmark runs opsmath and its anchors in one process on the same inputs (docs/design.md, Measuring).
"""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import tempfile
import time

import torch

from opsmath.kernels.autotune import kernel_ms  # device time per kernel; profile_gap.py uses it from here too

# A benchmark compiles one function for many shapes, dtypes and flags. Past dynamo's default of 8
# recompiles a function silently runs eager, and its rows would time eager under a compiled label.
torch._dynamo.config.recompile_limit = 256


def env() -> dict:
    import triton
    return dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version())


def bench(fn, warmup_ms: float = 25, rep_ms: float = 100, device: bool = False) -> dict:
    """Median milliseconds of ``fn()`` and the peak memory it allocates above what was resident.

    ``ms`` is wall time per call as the stream sees it (CUDA events, L2 flushed between calls), so a call
    whose host side (Python dispatch, autograd, kernel launches) outlasts its kernels is measured at its
    host time. With ``device=True`` the row also gets ``gpu_ms``: the summed time of the kernels one call
    runs (torch.profiler), i.e. what the op costs inside a training step whose host runs ahead of the GPU.
    """
    from triton.testing import do_bench
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    out = dict(ms=ms, peak_bytes=peak)
    if device:
        out["gpu_ms"] = sum(kernel_ms(fn).values())
    return out


def timed_calls(fns: dict, rounds: int, calls: int, after_round=None) -> dict:
    """{name: [ms per call, one per round]}: ``calls`` calls of each ``fns[name]()`` timed with CUDA events,
    the variants alternating within every round (A B A B: the GPU host's drift falls on all of them);
    ``after_round()`` runs after each round (e.g. to drop accumulated gradients)."""
    times: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / calls)
        if after_round is not None:
            after_round()
    return times


def out_path(filename: str) -> str:
    """``filename`` in the results folder: ``$OUT`` where set, else ``benchmarks/results``."""
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    return os.path.join(out_dir, filename)


def write(name: str, payload: dict) -> str:
    path = out_path(f"{name}-{time.strftime('%Y%m%d')}.json")
    with open(path, "w") as f:
        json.dump(dict(env=env(), **payload), f, indent=1)
    return path


def smoke_out(prefix: str) -> None:
    """``--smoke`` rows are not results: ``write`` puts them in a temporary folder unless ``OUT`` names one."""
    if not os.environ.get("OUT"):
        os.environ["OUT"] = tempfile.mkdtemp(prefix=f"{prefix}-smoke-")


def new_shape() -> None:
    """Call before the first call of a new shape: dynamo's caches are reset, so that ``torch.compile``
    baselines compile this shape statically, as a training step of fixed shapes does. Without it a second
    shape through one compiled function recompiles with dynamic sizes (automatic dynamic shapes): its
    kernels ran up to 3x slower (grouped GEMM casts, ``results/grouped-gemm-fp8-dynamic-shapes-*``)."""
    torch._dynamo.reset()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    if torch.isnan(a).any():
        return float("nan")
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class Stepper:
    """One training-step variant, built and warmed up. ``timed_round`` adds the median of ``steps`` timed
    steps to ``round_ms[accumulate]``, so that variants alternate round by round in one process
    (``interleave``: A B A B) and the host's noise falls on all of them. Subclasses define ``step``, which
    runs one optimizer step over ``accumulate`` micro-batches and returns the loss."""

    def __init__(self, label: str, device: str):
        self.label, self.device = label, device
        self.round_ms, self.error = {}, None

    def step(self, accumulate: int = 1):
        raise NotImplementedError

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def warm_up(self):
        """First step (capture + compile) timed, second untimed, third measured for the step's own peak
        above the resident weights, gradients and optimizer state (``peak_gib``; 0 off CUDA)."""
        t0 = time.perf_counter()
        self.first_loss = self.step().item()
        self.first_s = time.perf_counter() - t0
        self.step()
        self.sync()
        self.peak_gib = 0.0
        if self.device == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.step()
            self.sync()
            self.peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30

    def timed_round(self, steps: int, accumulate: int = 1):
        ms = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.step(accumulate)
            self.sync()
            ms.append((time.perf_counter() - t0) * 1e3)
        self.round_ms.setdefault(accumulate, []).append(statistics.median(ms))

    def timing(self, accumulate: int = 1) -> dict:
        """Median of the per-round medians, their spread and the rounds themselves."""
        rounds = self.round_ms[accumulate]
        return dict(ms=statistics.median(rounds), ms_min=min(rounds), ms_max=max(rounds), rounds=rounds)


def interleave(variants: list, rounds: int, steps: int, accumulate=(1,), catch: bool = False, after_round=None):
    """``rounds`` rounds, A B A B: in each, every variant runs ``timed_round(steps, k)`` for each ``k`` of
    ``accumulate``; then ``after_round(i)`` if given. With ``catch``, a variant whose round raises keeps the
    error in ``.error`` and sits out the later rounds; without, the error ends the run."""
    live = list(variants)
    for i in range(rounds):
        for k in accumulate:
            for v in live:
                try:
                    v.timed_round(steps, k)
                except Exception as e:  # noqa: BLE001
                    if not catch:
                        raise
                    v.error = f"{type(e).__name__}: {str(e)[:300]}"
        live = [v for v in live if not getattr(v, "error", None)]
        if after_round is not None:
            after_round(i)


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def _is_sync(name: str) -> bool:
    return "Synchronize" in name or name == "aten::item"


def sync_sites(step, frames: int = 6) -> list[dict]:
    """The host syncs of one ``step`` (CUDA runtime synchronizations, ``aten::item``) by where they come
    from: the innermost Python frames outside torch's profiler, with their count."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=True) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    sites: dict[tuple, int] = {}
    for e in prof.events():
        if _is_sync(e.name):
            chain, p = [], e.cpu_parent   # (Python frames are events of their own, parents of the ops)
            while p is not None and len(chain) < frames:
                if not p.name.startswith("<built-in") and "torch/profiler" not in p.name:
                    chain.append(p.name)
                p = p.cpu_parent
            sites[(e.name, tuple(chain))] = sites.get((e.name, tuple(chain)), 0) + 1
    return [dict(event=k[0], stack=list(k[1]), count=c) for k, c in sorted(sites.items(), key=lambda kv: -kv[1])]


def gpu_idle(step, steps: int = 2, trace: str | None = None) -> dict:
    """Where the GPU waits for the host inside a synchronized step: per step, its host wall time, the time
    from its start to the first kernel (``first_kernel_ms``), and the time no kernel or copy runs on any
    stream between the first kernel and the step's end (``idle_ms``), with the longest such gaps and the
    kernel each one ends at. ``trace``: a gzipped Chrome trace of the steps is written there (CPU and CUDA
    activity) for reading offline. Without CUDA: the wall times only."""
    import gzip
    import shutil
    from torch.profiler import ProfilerActivity, profile, record_function
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for i in range(steps):
            with record_function(f"opsmath-bench step {i}"):
                step()
                sync()
    evs = list(prof.profiler.kineto_results.events())
    marks = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in evs   # the host's ranges, not the GPU's
                   if e.name().startswith("opsmath-bench step") and e.device_type() == torch.autograd.DeviceType.CPU)
    device = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()) for e in evs
                    if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
                    and not e.name().startswith("opsmath-bench step"))   # the GPU's copy of a step's range
    rows = []
    for s, e in marks:
        ks = [k for k in device if s <= k[0] < e]
        row = dict(wall_ms=(e - s) / 1e6)
        if ks:
            gaps, reach = [], ks[0][1]
            for a, b, name in ks[1:]:
                if a > reach:
                    gaps.append((a - reach, name))
                reach = max(reach, b)
            row.update(first_kernel_ms=(ks[0][0] - s) / 1e6, idle_ms=sum(g for g, _ in gaps) / 1e6,
                       after_last_kernel_ms=(e - reach) / 1e6,
                       longest=[dict(us=round(g / 1e3, 1), before=n[:80]) for g, n in sorted(gaps, reverse=True)[:12]])
        rows.append(row)
    if trace:
        tmp = trace + ".tmp.json"
        prof.export_chrome_trace(tmp)
        with open(tmp, "rb") as f, gzip.open(trace, "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(tmp)
    return dict(steps=rows)


def idle_line(idle: dict) -> str:
    """``gpu_idle``'s steps in one line: wall, wait for the first kernel, idle, and the longest gaps."""
    return "; ".join(f"step {r['wall_ms']:.2f} ms: first kernel {r.get('first_kernel_ms', 0):.2f}, idle "
                     f"{r.get('idle_ms', 0):.2f}, after the last {r.get('after_last_kernel_ms', 0):.2f}; gaps "
                     + ", ".join(f"{g['us']}us<{g['before'][:40]}" for g in r.get("longest", [])[:6])
                     for r in idle["steps"])


def host_breakdown(step, steps: int = 3, top: int = 20, trace: str | None = None) -> dict:
    """Where the host time of a step goes: per step, the wall time with the GPU synchronized at the end,
    the kernel launches and host syncs (torch.profiler's CUDA runtime events; ``sync_sites``: where
    they come from, one more step profiled with stacks), the ops with the most CPU self time (``ops``),
    and the Python functions with the most own time (cProfile, ``python``; run without the profiler). A
    host-bound step is one whose wall time outruns its kernels (``gpu_ms``); ``gpu_idle`` says where."""
    import cProfile
    import pstats
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        sync()
    events = prof.key_averages()
    count = {e.key: e.count / steps for e in events}
    ops = sorted(((e.key, e.self_cpu_time_total / steps / 1e3, e.count / steps) for e in events),
                 key=lambda kv: -kv[1])[:top]
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(steps):
        step()
    sync()
    pr.disable()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    stats = pstats.Stats(pr).stats   # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    py = sorted(((f"{os.path.basename(k[0])}:{k[1]}({k[2]})", v[2] * 1e3 / steps, v[1] / steps)
                 for k, v in stats.items()), key=lambda kv: -kv[1])[:top]
    syncs = sum(c for k, c in count.items() if _is_sync(k))
    return dict(wall_ms_profiled=wall, gpu_idle=gpu_idle(step, trace=trace), python_calls=sum(v[1] for v in stats.values()) / steps,
                launches=sum(count.get(k, 0) for k in LAUNCHES), syncs=syncs,
                sync_sites=sync_sites(step) if syncs else [],
                ops=[dict(name=n, self_cpu_ms=round(ms, 3), calls=c) for n, ms, c in ops],
                python=[dict(name=n, own_ms=round(ms, 3), calls=c) for n, ms, c in py])


# what a training step's GPU time goes to, by kernel name (``kernel_classes``), first match wins
KERNEL_CLASSES = (
    ("optimizer", re.compile(r"multi_tensor_apply|Adam|adamw", re.I)),
    ("attention", re.compile(r"sdpa|flash|fmha|_attn_|attention", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|xmma|sm90_|cublas|_mm_|grouped_mm", re.I)),
    ("casts", re.compile(r"^triton_\w+_fused__to_copy(_(t|view|permute|clone|_unsafe_view|transpose))*_\d+$")),
)


def kernel_classes(per: dict) -> dict:
    """``{kernel name: ms}`` summed by class (``KERNEL_CLASSES``; "casts": Inductor kernels that only change
    a dtype, the views around it included), the rest as "other"."""
    out = dict.fromkeys([c for c, _ in KERNEL_CLASSES] + ["other"], 0.0)
    for name, ms in per.items():
        out[next((c for c, pat in KERNEL_CLASSES if pat.search(name)), "other")] += ms
    return {k: round(v, 4) for k, v in out.items()}
