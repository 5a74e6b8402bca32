"""Tuning workers (``kernels/prewarm.py``): jobs run in worker processes whose Triton launches only
compile; a job that fails or a host without workers costs nothing but the in-process compile."""
import os

import pytest
import torch

from opsmath.kernels import prewarm


def launches_only_compile() -> tuple[bool, int, str]:
    """A worker job: whether Triton's launch only compiles there (its initializer replaces it), its pid,
    and the Triton cache it compiles into."""
    from triton.runtime.jit import JITFunction
    return getattr(JITFunction.run, "opsmath_compile_only", False), os.getpid(), os.environ.get("TRITON_CACHE_DIR")


def fails() -> None:
    raise ValueError("no such configuration")


def hangs() -> None:
    import time
    time.sleep(600)


def test_no_workers_off_cuda_or_when_turned_off(monkeypatch):
    assert prewarm.workers(torch.device("cpu")) == 0
    assert prewarm.start([(fails, ())], torch.device("cpu")) == [None]
    assert prewarm.wait(None) is False
    monkeypatch.delenv("OPSMATH_TUNE_WORKERS", raising=False)   # opt-in
    assert prewarm.workers(torch.device("cuda", 0)) == 0
    monkeypatch.setenv("OPSMATH_TUNE_WORKERS", "0")
    assert prewarm.workers(torch.device("cuda", 0)) == 0


def test_workers_compile_only_and_a_failed_job_is_only_a_miss(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(prewarm, "workers", lambda device: 1)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/first")
    try:
        ok, bad = prewarm.start([(launches_only_compile, ()), (fails, ())], torch.device("cpu"))
        assert prewarm.wait(ok) and prewarm.wait(bad) is False
        compile_only, pid, cache = ok.result()
        assert compile_only and pid != os.getpid() and cache == "/tmp/first"
        monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/later")   # as Inductor's first compile sets it
        assert prewarm.start([(launches_only_compile, ())], torch.device("cpu"))[0].result()[1:] == (pid, "/tmp/later")
        from triton.runtime.jit import JITFunction
        assert not getattr(JITFunction.run, "opsmath_compile_only", False)   # this process launches as ever
        pending = prewarm.Pending(torch.device("cpu"), {"a": (launches_only_compile, ()), "b": (fails, ())})
        assert pending.ready(None) is False and pending.ready("a") and pending.ready("a") is False
        assert pending.ready("b") is False
    finally:
        workers = list(prewarm._WORKERS)
        prewarm.stop()
    assert prewarm._QUEUE[0] is None and workers and all(p.poll() is not None for p in workers)


def test_a_hung_worker_costs_the_wait_and_never_holds_up_exit(monkeypatch):
    """A job that never ends: the tuner waits ``WAIT_S`` and compiles itself; the job queued behind it is
    dropped; ``stop`` (at exit) kills the worker within seconds; the feeding threads are daemons."""
    import threading
    import time
    pytest.importorskip("triton")
    monkeypatch.setattr(prewarm, "workers", lambda device: 1)
    monkeypatch.setattr(prewarm, "WAIT_S", 0.5)
    stuck, queued = prewarm.start([(hangs, ()), (hangs, ())], torch.device("cpu"))
    assert prewarm.wait(stuck) is False
    procs, t0 = list(prewarm._WORKERS), time.perf_counter()
    prewarm.stop()
    assert time.perf_counter() - t0 < 15 and queued.cancelled()
    assert procs and all(p.poll() is not None for p in procs)
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("opsmath-tune"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_tuner_loads_what_the_workers_compiled(monkeypatch, tmp_path):
    """Own-only attention tuning (a window: no vendor) on cold caches with two workers: the default
    configuration compiles in this process, every other one loads from Triton's disk cache (its first
    call, ``took[name][0]``, a fraction of the default's compile)."""
    import json

    from opsmath.kernels import autotune
    from opsmath.kernels.attention.tuning import choose
    monkeypatch.setenv("OPSMATH_TUNE_WORKERS", "2")
    monkeypatch.setenv("OPSMATH_CACHE_DIR", str(tmp_path / "opsmath"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    try:
        choose((2, 4, 333, 64), (2, 2, 333, 64), torch.bfloat16, torch.device("cuda"), None, None, float("-inf"),
               True, 0.125, 0.0, vendors=False, window=96)
    finally:
        prewarm.stop()
    entries = [e for ops in json.loads((tmp_path / "opsmath" / "tuning.json").read_text()).values()
               for e in ops.get("attention", {}).values()]
    took = entries[0]["took"]
    assert len(took) >= 3 and not entries[0]["errors"], entries
    default = took["opsmath"][0]
    assert all(t[0] < 0.3 * default for name, t in took.items() if name != "opsmath"), took
