"""The GPU benchmarks run end to end at toy size on CPU (``python -m benchmarks NAME --smoke``): device time
is scarce, so a benchmark that would crash there is caught here. They measure nothing in this mode and write
no results. Each runs through ``benchmarks.__main__.main`` inside the test's process (a child process
spent 5-10 s of a two-core machine importing torch and transformers again), as a fresh process would run
it: the ``benchmarks`` modules imported anew, and the environment, ``sys.argv``, ``torch.compile`` and
torch's compiler settings restored afterwards."""
import inspect
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow   # left out of the quick run (README: -m "not slow")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


@pytest.mark.parametrize("args", [
    ["train", "--smoke"],
    ["hf_default_attention", "--smoke"],
    ["varying_lengths", "--smoke"],
    ["varying_lengths", "--smoke", "--model", "bloom4"],
    ["activations", "--smoke"],
    ["cross_entropy", "--smoke"],
    ["learning_curve", "--smoke"],
    ["fp8_curve", "--smoke"],
    ["fp8_curve", "--smoke", "--model", "gpt2", "--fp8-min-dim", "16", "--data-vocab", "64", "--no-torchao", "--amp"],
    ["memory", "--smoke", "--quick", "--paths", "op-by-op", "--lengths", "64,128"],
    ["memory", "--smoke", "--model", "llama", "--no-long", "--no-anchors", "--paths", "op-by-op",
     "--fractions", "0.5"],
    ["card", "--smoke", "--cards", "8GiB", "--steps", "2"],
    ["inductor_partition", "--smoke"],
    ["sass_stats", "--op", "dropout_add_norm", "--width", "256", "--config", "1"],
    ["moe", "--smoke", "--variants", "torch.compile,opsmath.optimize"],
    ["moe", "--smoke", "--curve", "3", "--curve-fp8", "every"],
    ["multi_gpu", "--smoke"],
    ["first_call", "--smoke", "--cases", "bert-mask"],
    ["first_step", "--smoke", "--models", "gpt2", "--variants", "opsmath.optimize"],
    ["plan_partition", "--layers", "1", "--budgets", "0.5", "--batch", "1", "--seq", "128"],
], ids=lambda a: a[0])
def test_benchmark_script_smoke(args, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("OPSMATH_CACHE_DIR", str(tmp_path / "cache"))
    assert run_in_process(args, monkeypatch) in (0, None)


# what a benchmark may set for the rest of its process (``_harness``: dynamo's recompile limit)
CONFIGS = (torch._dynamo.config, torch._functorch.config, torch._inductor.config)


def module_settings() -> dict:
    """What a benchmark may rebind in opsmath's and torch's modules for the rest of its process:
    UPPER_CASE settings (``fp8_curve --fp8-min-dim``: the fp8 rule's ``MIN_DIM``) and functions or
    classes (``inductor_partition`` wraps torch's partitioner), by module."""
    return {m: {k: v for k, v in vars(m).items() if k.isupper() or inspect.isroutine(v) or inspect.isclass(v)}
            for name, m in list(sys.modules.items())
            if m is not None and name.split(".")[0] in ("opsmath", "torch")}


def restore(settings: dict) -> None:
    for module, saved in settings.items():
        for k, v in saved.items():
            if vars(module).get(k) is not v:
                setattr(module, k, v)


def run_in_process(args, monkeypatch):
    """``python -m benchmarks *args`` from the repository root, in this process: its exit code. The
    ``benchmarks`` submodules are imported anew (their module-level settings apply, as in a new process)
    and dropped after; the environment, compiler settings and module settings are put back as they were."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(ROOT)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(torch, "compile", torch.compile)   # ``--smoke`` wraps it (benchmarks/__main__.py)
    env, configs, settings = dict(os.environ), [c.get_config_copy() for c in CONFIGS], module_settings()

    def drop_submodules():
        for name in [m for m in sys.modules if m.startswith("benchmarks.")]:
            del sys.modules[name]
    drop_submodules()
    try:
        from benchmarks.__main__ import main
        return main(list(args))
    except SystemExit as e:
        return e.code
    finally:
        drop_submodules()
        os.environ.clear()
        os.environ.update(env)
        for config, saved in zip(CONFIGS, configs):
            now = config.get_config_copy()
            config.load_config({k: v for k, v in saved.items() if now[k] != v})
        restore(settings)


def test_every_benchmark_listed_by_family():
    """``python -m benchmarks`` lists every module under a family of its own, with its docstring's first line."""
    r = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-4000:]
    sys.path.insert(0, ROOT)
    from benchmarks import FAMILIES, names, summary
    listed = [n for mods in FAMILIES.values() for n in mods]
    assert sorted(listed) == names(), (sorted(set(names()) - set(listed)), sorted(set(listed) - set(names())))
    assert "other:" not in r.stdout
    for n in names():
        assert summary(n) and f"  {n} " in r.stdout, n


def test_exposed_communication_from_a_trace():
    """multi_gpu.py's exposed NCCL time: kernels read from a Chrome trace, NCCL time not covered by any
    compute kernel (compute intervals merged first)."""
    sys.path.insert(0, ROOT)
    from benchmarks.multi_gpu import kernels_of, overlap_ms
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "ampere_gemm", "ts": 0, "dur": 100},
        {"cat": "kernel", "name": "triton_fused", "ts": 80, "dur": 40},        # merged: 0-120
        {"cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 100, "dur": 50},   # 20 us covered
        {"cat": "cpu_op", "name": "nccl:all_reduce", "ts": 0, "dur": 500},     # host event: not a kernel
        {"cat": "kernel", "name": "ncclKernel_AllGather", "ts": 200, "dur": 10}]}   # not covered
    total, exposed = overlap_ms(kernels_of(trace))
    assert abs(total - 0.060) < 1e-9 and abs(exposed - 0.040) < 1e-9, (total, exposed)


def test_host_breakdown_names_where_each_sync_comes_from(monkeypatch):
    """``fleet --host``: a step's host syncs are counted and traced to the Python frames that made them
    (``aten::item`` on the CPU; CUDA's synchronizations on a GPU)."""
    monkeypatch.syspath_prepend(ROOT)
    from benchmarks._harness import host_breakdown
    x = torch.randn(8)

    def reads_the_loss():
        return (x * 2).sum().item()
    h = host_breakdown(reads_the_loss, steps=2, top=5)
    assert h["syncs"] == 1
    (site,) = h["sync_sites"]
    assert site["event"] == "aten::item" and site["count"] == 1
    assert any("reads_the_loss" in frame for frame in site["stack"]), site
