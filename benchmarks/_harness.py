"""Shared benchmark plumbing: environment record, CUDA-event timing (median), peak memory, JSON out.

Every benchmark runs opsmath and its anchors in one process on the same inputs (docs/design.md, Measuring).
"""
from __future__ import annotations

import json
import os
import platform
import time

import torch

from opsmath.kernels.autotune import kernel_ms  # device time per kernel; profile_gap.py uses it from here too

# A benchmark compiles one function for many shapes, dtypes and flags. Past dynamo's default of 8
# recompiles a function silently runs eager: the 2026-11-29 dropout-add-norm torch.compile rows did.
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


def write(name: str, payload: dict) -> str:
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}-{time.strftime('%Y%m%d')}.json")
    with open(path, "w") as f:
        json.dump(dict(env=env(), **payload), f, indent=1)
    return path


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    if torch.isnan(a).any():
        return float("nan")
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()
