"""Autotuning shared by every kernel: measure candidates once, remember the winner on disk.

A *choice* is keyed on the machine and software (GPU name, opsmath, torch and triton versions, and what the
choices are ranked by: caches from before choices were ranked by kernel time are re-tuned), then on the op
and a key the op builds from its dtype and a shape bucket::

    {"NVIDIA H200 | opsmath 0.1.0 | torch 2.11.0 | triton 3.6.0 | kernel time": {"attention": {
        "bf16 B*H=128 S=1024x1024 ...": {"choice": "sdpa_cudnn", "ms": {"opsmath": 1.92, "sdpa_cudnn": 0.81}}}}}

stored as JSON in ``$OPSMATH_CACHE_DIR/tuning.json`` (default ``~/.cache/opsmath``, or
``$XDG_CACHE_HOME/opsmath``). A later process reuses the choice without measuring. The file is a small
database that many processes share (DDP ranks under one home directory):
- every entry is validated as it is read; a malformed one (a machine mapping to a list, a choice that is
  not a string) is dropped and re-tuned, with one warning naming the file;
- a file that does not parse is set aside (renamed ``*.corrupt``) and re-tuned; a read that fails for
  another reason (a transient I/O error) keeps the file and only this read is lost;
- a write is a read-modify-write under an exclusive lock on ``tuning.json.lock`` (``fcntl.flock``: every
  process's entries survive), through a temporary file renamed atomically (readers never see half a
  file), which is removed if the write fails. A read-only cache never stops training.

``pick(op, key, candidates)`` measures each candidate (a zero-argument callable running the op's
forward and backward) by its GPU kernel time per call (``measure``: torch.profiler, falling back to
``triton.testing.do_bench``'s median wall time), skips candidates that raise, and shows a transient rich
progress bar on a terminal when tuning is under way. An entry keeps where the tuning time went:
``seconds`` in all, and per candidate ``took``: [its first call (a Triton kernel's compile), its timing].
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

try:
    import fcntl
except ImportError:   # Windows: no advisory locks; writes stay atomic, concurrent writers may lose entries
    fcntl = None

log = logging.getLogger("opsmath")
_LOCK = threading.Lock()
_MEMORY: dict[tuple[str, str, str], str] = {}   # (machine, op, key) -> choice, this process
_WARNED: set[str] = set()                      # cache files already reported malformed, this process
# this process: seconds spent measuring candidates, choices measured, and of those seconds the
# candidates' first calls (where Triton compiles)
SPENT = {"seconds": 0.0, "tuned": 0, "first_calls": 0.0}
METRIC = "kernel time"   # what choices are ranked by (``measure``); choices ranked otherwise are not reused


def cache_path() -> Path:
    root = os.environ.get("OPSMATH_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "opsmath")
    return Path(root) / "tuning.json"


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("opsmath")
    except Exception:  # noqa: BLE001  (run from a source tree that is not installed)
        return "unknown"


@functools.lru_cache(maxsize=None)
def machine_key(device: Optional[torch.device] = None) -> str:
    import triton
    gpu = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"
    return f"{gpu} | opsmath {_version()} | torch {torch.__version__} | triton {triton.__version__} | {METRIC}"


def cached(op: str, key: str) -> Optional[str]:
    """The stored choice for ``(op, key)`` on this machine, or None; read from disk once per process
    (a miss is remembered too), so kernels may call it on every launch."""
    machine = machine_key()
    if (machine, op, key) not in _MEMORY:
        entry = lookup(op, key, machine)
        _MEMORY[(machine, op, key)] = entry["choice"] if entry else None
    return _MEMORY[(machine, op, key)]


def _valid(data: dict, path: Path) -> dict:
    """``data`` with every malformed machine, op or entry dropped (one warning per file and process)."""
    clean, dropped = {}, 0
    for machine, ops in data.items():
        if not isinstance(ops, dict):
            dropped += 1
            continue
        for op, entries in ops.items():
            if not isinstance(entries, dict):
                dropped += 1
                continue
            good = {k: e for k, e in entries.items() if isinstance(e, dict) and isinstance(e.get("choice"), str)}
            dropped += len(entries) - len(good)
            if good:
                clean.setdefault(machine, {})[op] = good
    if dropped and str(path) not in _WARNED:
        _WARNED.add(str(path))
        log.warning("opsmath: tuning cache %s has %d malformed entries; they are dropped and re-tuned", path, dropped)
    return clean


def load() -> dict:
    """The cache file's well-formed entries; ``{}`` when absent. A file that does not parse is renamed
    aside; one that cannot be read now (an I/O error) is left in place."""
    path = cache_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("opsmath: tuning cache %s cannot be read now (%s); tuning without it", path, e)
        return {}
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("top level is not an object")
    except ValueError as e:
        log.warning("opsmath: tuning cache %s is corrupt (%s); set aside and re-tuned", path, e)
        with contextlib.suppress(OSError):
            path.replace(path.with_suffix(".json.corrupt"))
        return {}
    return _valid(data, path)


def lookup(op: str, key: str, machine: Optional[str] = None) -> Optional[dict]:
    return load().get(machine or machine_key(), {}).get(op, {}).get(key)


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock across processes (and threads) for a read-modify-write of ``path``."""
    with _LOCK:
        if fcntl is None:
            yield
            return
        with open(path.with_suffix(".json.lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def store(op: str, key: str, entry: dict, machine: Optional[str] = None) -> None:
    """Persist ``entry`` (its ``choice`` a string) for ``(op, key)``; this process's ``cached`` sees it."""
    machine = machine or machine_key()
    path = cache_path()
    _MEMORY[(machine, op, key)] = entry["choice"]
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(path):
            data = load()
            data.setdefault(machine, {}).setdefault(op, {})[key] = entry
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
            tmp = None
    except OSError as e:  # a read-only home must not stop training: keep the choice in memory
        log.warning("opsmath: cannot write tuning cache %s (%s)", path, e)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def wall_ms(fn: Callable[[], object], warmup_ms: float = 10, rep_ms: float = 40) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream, launch (host) time included."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def kernel_ms(fn: Callable[[], object], calls: int = 10) -> dict[str, float]:
    """{kernel name: device milliseconds per call of ``fn``}, from torch.profiler's CUDA activity only
    (memsets and copies included; host time and the gaps between kernels not)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "self_device_time_total", 0) > 0:
            per[e.key] += e.self_device_time_total / 1e3 / calls
    return dict(per)


def measure_kernels(fn: Callable[[], object], warmup_ms: float = 10, rep_ms: float = 40) -> dict[str, float]:
    """``kernel_ms`` over about ``rep_ms`` of calls after a warm-up; ``{}`` when a profiler is already
    running (the user's own) or CUPTI is unavailable."""
    import warnings

    if torch.autograd._profiler_enabled():
        return {}
    first = wall_ms(fn, warmup_ms=warmup_ms, rep_ms=min(rep_ms, 10))
    calls = int(max(3, min(100, rep_ms / max(first, 1e-3))))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return kernel_ms(fn, calls)
    except RuntimeError as e:   # CUPTI unavailable or busy: rank by wall time rather than fail
        log.info("opsmath: profiler unavailable for tuning (%s); using wall time", e)
        return {}


def measure(fn: Callable[[], object], warmup_ms: float = 10, rep_ms: float = 40,
            on_kernels: Optional[Callable[[dict], None]] = None) -> float:
    """Milliseconds of GPU kernel time per call of ``fn()``: what a candidate costs a training step that
    keeps the GPU busy, where its launch (host) time overlaps earlier kernels. Wall time would rank
    candidates by their Python launch paths at small shapes: on the H200, SDPA's flash and cuDNN took
    the same 0.54 ms of wall time for (8, 16, 1024, 64) attention while cuDNN's kernels ran 1.6x faster
    (2026-11-29). Falls back to wall time (``wall_ms``) when ``measure_kernels`` has no kernels.
    ``on_kernels`` receives the per-kernel times when there are any (a caller choosing per kernel)."""
    per = measure_kernels(fn, warmup_ms, rep_ms)
    if per and on_kernels is not None:
        on_kernels(per)
    total = sum(per.values())
    return total if total > 0 else wall_ms(fn, warmup_ms, rep_ms)


def pick(op: str, key: str, candidates: dict[str, Callable[[], object]],
         measure_fn: Callable[[Callable[[], object]], float] = measure, *,
         skip: Optional[Callable[[str, dict[str, float]], bool]] = None, sync: bool = True) -> str:
    """The fastest candidate's name for ``(op, key)``: from this process, then the disk cache, else
    measured now (and stored). A cached choice that is not among ``candidates`` is re-tuned.
    Candidates are measured in order; ``skip(name, times so far)`` may leave one out unmeasured (one
    that cannot win given what was measured: its compile and timing are saved).

    With ``OPSMATH_TUNE_SYNC=1`` under ``torch.distributed``, every rank makes its own choice, then all
    take rank 0's (one small broadcast, made whether or not the choice was cached, so ranks whose caches
    differ still meet in the same collective), so timing noise cannot give ranks different kernels.
    It is opt-in because it is a collective: a graph captured on one rank only (evaluation on rank 0)
    would wait for the others forever. Without it each rank keeps its own (always accurate) choice;
    sharing one pre-tuned cache file (``opsmath tune``) gives every rank the same choices too.
    ``sync=False`` never makes that collective: for choices made at a kernel's first launch, which may be
    inside backward (the autograd thread, beside DDP's own collectives)."""
    choice = _pick_local(op, key, candidates, measure_fn, skip)
    if not sync:
        return choice
    agreed = _agree(choice)
    if agreed != choice:
        machine = machine_key()
        _MEMORY[(machine, op, key)] = agreed
        log.info("opsmath: %s [%s]: rank 0 chose %s (this rank measured %s)", op, key, agreed, choice)
    return agreed


def _agree(choice: str) -> str:
    import torch.distributed as dist
    if os.environ.get("OPSMATH_TUNE_SYNC") != "1" or not (dist.is_available() and dist.is_initialized()) \
            or dist.get_world_size() == 1:
        return choice
    box = [choice]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class AllCandidatesFailed(RuntimeError):
    """No candidate ran for these shapes on this GPU (each raised: ``errors``, name -> message), e.g. every
    block configuration of a Triton kernel needing more shared memory than the GPU has."""

    def __init__(self, message: str, errors: dict[str, str]):
        super().__init__(message)
        self.errors = errors


def _pick_local(op, key, candidates, measure_fn, skip=None) -> str:
    if not candidates:
        raise ValueError(f"no candidates to tune {op} [{key}]")
    machine = machine_key()
    mem = _MEMORY.get((machine, op, key))
    if mem is not None and mem in candidates:
        return mem
    cached = lookup(op, key, machine)
    if cached and cached["choice"] in candidates:
        _MEMORY[(machine, op, key)] = cached["choice"]
        return cached["choice"]
    times, errors, skipped, took, t0 = {}, {}, [], {}, time.perf_counter()
    with _progress(f"tuning {op} [{key}]", len(candidates)) as advance:
        for name, fn in candidates.items():
            if skip is not None and skip(name, dict(times)):
                skipped.append(name)
            else:
                start = first = time.perf_counter()
                try:   # the first call apart: a Triton candidate compiles there
                    _synced(fn)
                    first = time.perf_counter()
                    times[name] = measure_fn(fn)
                except Exception as e:  # a backend that rejects these inputs is not a candidate
                    errors[name] = f"{type(e).__name__}: {str(e)[:160]}"
                took[name] = [round(first - start, 2), round(time.perf_counter() - first, 2)]
            advance()
    if not times:
        raise AllCandidatesFailed(f"every candidate failed for {op} [{key}]: {errors}", errors)
    choice, spent = min(times, key=times.get), time.perf_counter() - t0
    SPENT["seconds"], SPENT["tuned"] = SPENT["seconds"] + spent, SPENT["tuned"] + 1
    SPENT["first_calls"] += sum(t[0] for t in took.values())
    store(op, key, dict(choice=choice, ms={k: round(v, 5) for k, v in times.items()}, errors=errors,
                        seconds=round(spent, 2), took=took, **(dict(skipped=skipped) if skipped else {})), machine)
    _MEMORY[(machine, op, key)] = choice
    log.info("opsmath: %s [%s] -> %s (%s)", op, key, choice, times)
    return choice


def _synced(fn: Callable[[], object]) -> None:
    """``fn()``, waited for on the GPU when CUDA is in use."""
    fn()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _progress:
    """A transient rich progress bar on a terminal (tuning takes a second or more); silent otherwise."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.bar = what, total, None

    def __enter__(self):
        import sys
        if sys.stderr.isatty():
            from rich.progress import Progress
            self.bar = Progress(transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.what, total=self.total)
        return self.advance

    def advance(self):
        if self.bar is not None:
            self.bar.advance(self.task)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False
