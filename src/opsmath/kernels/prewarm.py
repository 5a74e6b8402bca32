"""Compile a tuner's Triton candidates in worker processes while it measures the others.

Tuning a Triton kernel's block configurations is almost all compile time. On the H200, each attention
configuration (three kernels) took 3.3-5.4 s to compile and 0.1 s to time
(``benchmarks/results/tuning-cache-gemma2-bf16-20261204.json``); Gemma-2's window layers spent 17.9 s
tuning four of them. Triton compiles while holding the GIL, so threads do not help, but processes do.
``start(jobs)`` hands each job (a module-level function and its picklable arguments) to a pool of worker
processes (``python -c "...serve()"``: fresh interpreters that import opsmath, never the user's script
as multiprocessing's spawn would). There every Triton launch only compiles (``JITFunction.run`` with
``warmup=True``: nothing runs on the GPU, so the tuner's timings are not disturbed), and Triton writes
the kernels to its on-disk cache. The tuner's own first call of that candidate then launches the same
kernel with the same argument types, sizes and alignment, so the JIT should find it there and load it
instead of compiling it (not yet confirmed on a GPU).

- A job that fails costs its CPU time only; one not done within ``WAIT_S`` also that wait. Either way
  the tuner's first call of the candidate compiles, as it would without workers.
- Opt-in: ``OPSMATH_TUNE_WORKERS=N`` starts N workers (4 suits a 16-core host); unset, tuning compiles
  in-process. Only with CUDA, and not when the GPU has less than ``MIN_FREE`` bytes free: each worker
  holds a CUDA context of about 0.5 GiB.
- Workers start once per process, on first use, and stop at exit (or when their input closes).
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
from typing import Callable, Optional

import torch

log = logging.getLogger("opsmath")

MIN_FREE = 8 << 30    # GPU bytes free below which no worker is started (each holds a CUDA context)
WAIT_S = 60.0         # the longest the tuner waits for a job before compiling the candidate itself
_QUEUE: list = [None, 0]  # the jobs waiting for a worker, and the daemon threads feeding them to the processes
_WORKERS: list = []    # every worker process started
# where Triton keeps compiled kernels: sent with every job, as this process has it then (Inductor sets
# TRITON_CACHE_DIR at its first compile, after the workers may have started)
CACHE_ENV = ("TRITON_CACHE_DIR", "TRITON_HOME")


def workers(device: torch.device) -> int:
    """How many worker processes to use for tuning on ``device``: ``OPSMATH_TUNE_WORKERS`` (unset: 0,
    until the saving is measured on a GPU), and 0 off CUDA or with less than ``MIN_FREE`` bytes free."""
    n = int(os.environ.get("OPSMATH_TUNE_WORKERS") or 0)
    if n <= 0 or device.type != "cuda":
        return 0
    try:
        free, _ = torch.cuda.mem_get_info(device)
    except RuntimeError:
        return 0
    return 0 if free < MIN_FREE else n


def _compile_only() -> None:
    """In a worker: every Triton launch compiles (and caches) its kernel without running it."""
    import functools

    from triton.runtime.jit import JITFunction
    run = JITFunction.run

    @functools.wraps(run)
    def compile_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)
    compile_only.opsmath_compile_only = True
    JITFunction.run = compile_only


def serve() -> None:
    """A worker's loop: read pickled ``(fn, args, env)`` jobs from stdin until it closes (``env``: the
    ``CACHE_ENV`` variables to run it under), answer each with a
    pickled ``(True, what fn returned)`` or ``(False, the error)`` on the original stdout (anything the
    jobs print goes to stderr)."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _compile_only()
    while True:
        try:
            fn, args, env = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        for k, v in env.items():   # the tuner's cache location now (Inductor sets one at its first compile)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            reply = (True, fn(*args))
        except Exception as e:   # reported to the tuner, which compiles the candidate itself
            reply = (False, f"{type(e).__name__}: {str(e)[:300]}")
        pickle.dump(reply, replies)
        replies.flush()


def _worker() -> subprocess.Popen:
    """A new worker process: a fresh interpreter that imports opsmath (and what the jobs' modules need
    from this process's ``sys.path``) and runs ``serve``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, "-c", "from opsmath.kernels.prewarm import serve; serve()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    _WORKERS.append(proc)
    return proc


def _feed(jobs: queue.Queue) -> None:
    """A daemon thread's loop: hand each job to this thread's worker process (started on first use) and
    settle its future. Daemon, so a worker that hangs never holds up the interpreter's exit."""
    proc = None
    while True:
        future, fn, args = jobs.get()
        if future is None:   # stop()
            return
        if not future.set_running_or_notify_cancel():   # cancelled before it started
            continue
        try:
            if proc is None or proc.poll() is not None:
                proc = _worker()
            pickle.dump((fn, args, {k: os.environ.get(k) for k in CACHE_ENV}), proc.stdin)
            proc.stdin.flush()
            ok, result = pickle.load(proc.stdout)
        except Exception as e:   # the worker died or its pipe broke: this job is a miss
            future.set_exception(e)
            continue
        if ok:
            future.set_result(result)
        else:
            future.set_exception(RuntimeError(result))


def start(jobs: list[tuple[Callable, tuple]], device: torch.device) -> list[Optional[cf.Future]]:
    """Submit ``fn(*args)`` for each job to the workers. Returns one future per job, or None where no
    worker takes it (no workers here)."""
    n = workers(device) if jobs else 0
    if n == 0:
        return [None] * len(jobs)
    if _QUEUE[0] is None:
        _QUEUE[:] = [queue.Queue(), n]
        for i in range(n):
            threading.Thread(target=_feed, args=(_QUEUE[0],), name=f"opsmath-tune-{i}", daemon=True).start()
        atexit.register(stop)
    futures = [cf.Future() for _ in jobs]
    for f, (fn, args) in zip(futures, jobs):
        _QUEUE[0].put((f, fn, args))
    return futures


def wait(future: Optional[cf.Future]) -> bool:
    """Wait for one job, at most ``WAIT_S``. True when it finished without an error."""
    if future is None:
        return False
    try:
        future.result(timeout=WAIT_S)
        return True
    except Exception as e:   # the candidate's own first call compiles instead
        log.info("opsmath: a tuning worker's compile did not finish (%s: %s)", type(e).__name__, str(e)[:200])
        return False


def cancel(futures: list[Optional[cf.Future]]) -> None:
    """Drop the jobs that have not started (their candidates will not be measured)."""
    for f in futures:
        if f is not None:
            f.cancel()


class Pending:
    """Jobs keyed by candidate, started at the first ``ready`` call (when a tuner begins measuring, not
    when it finds its choice cached). ``ready(key)`` starts them all if not yet started, then waits for
    ``key``'s job, if any and only once: call it before a candidate's first call."""

    def __init__(self, device: torch.device, jobs: dict):
        self.device, self.jobs, self.futures = device, jobs, None

    def ready(self, key) -> bool:
        if self.futures is None:
            self.futures = dict(zip(self.jobs, start(list(self.jobs.values()), self.device)))
        return wait(self.futures.pop(key, None))

    def cancel(self) -> None:
        cancel(list((self.futures or {}).values()))


def stop() -> None:
    """Stop the workers (at exit): their input closes and their loop ends; one still busy after 5 s is
    killed. Jobs not yet started are dropped. A later ``start`` begins new ones."""
    q, threads = _QUEUE
    _QUEUE[:] = [None, 0]
    while q is not None and not q.empty():
        q.get_nowait()[0].cancel()
    for _ in range(threads):   # each feeding thread ends at its next look at the queue
        q.put((None, None, None))
    while _WORKERS:
        proc = _WORKERS.pop()
        try:
            proc.stdin.close()
            proc.wait(timeout=5)
        except Exception:
            proc.kill()
            proc.wait(timeout=5)
