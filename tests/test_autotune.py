"""The tuning cache (``src/opsmath/kernels/autotune.py``): measured once, reused by a later process,
corrupt or stale files re-tuned, never fatal. Measurement is replaced by a recorded fake here."""
import json
import subprocess
import sys

import pytest

from opsmath.kernels import autotune


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSMATH_CACHE_DIR", str(tmp_path))
    autotune._MEMORY.clear()
    yield tmp_path / "tuning.json"
    autotune._MEMORY.clear()


def fake_measure(times, calls):
    def measure(fn):
        calls.append(fn.__name__)
        return times[fn.__name__]
    return measure


def named(name, fail=False):
    def fn():
        if fail:
            raise RuntimeError("unsupported")
    fn.__name__ = name
    return fn


def test_pick_measures_once_then_reads_the_cache(cache):
    calls = []
    cands = {"a": named("a"), "b": named("b")}
    assert autotune.pick("op", "k1", cands, fake_measure({"a": 2.0, "b": 1.0}, calls)) == "b"
    assert calls == ["a", "b"]
    entry = json.loads(cache.read_text())[autotune.machine_key()]["op"]["k1"]
    assert entry["choice"] == "b" and entry["ms"] == {"a": 2.0, "b": 1.0}
    autotune._MEMORY.clear()   # as a new process would: only the file remains
    assert autotune.pick("op", "k1", cands, fake_measure({"a": 0.1, "b": 9.0}, calls)) == "b"
    assert calls == ["a", "b"]   # not re-measured


def test_a_later_process_reuses_the_choice(cache):
    autotune.pick("op", "k", {"x": named("x"), "y": named("y")}, fake_measure({"x": 1.0, "y": 3.0}, []))
    code = ("from opsmath.kernels import autotune\n"
            "def boom(fn): raise AssertionError('re-measured')\n"
            "print(autotune.pick('op', 'k', {'x': None, 'y': None}, boom))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "OPSMATH_CACHE_DIR": str(cache.parent)})
    assert out.stdout.strip() == "x"


def test_failing_candidates_are_skipped_and_recorded(cache):
    cands = {"bad": named("bad", fail=True), "ok": named("ok")}

    def measure(fn):
        fn()
        return 1.0
    assert autotune.pick("op", "k", cands, measure) == "ok"
    assert "bad" in json.loads(cache.read_text())[autotune.machine_key()]["op"]["k"]["errors"]
    with pytest.raises(RuntimeError, match="every candidate failed"):
        autotune.pick("op", "k2", {"bad": named("bad", fail=True)}, measure)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "\x00\x01"])
def test_corrupt_cache_is_set_aside_and_retuned(cache, content):
    cache.write_text(content)
    calls = []
    assert autotune.pick("op", "k", {"a": named("a")}, fake_measure({"a": 1.0}, calls)) == "a"
    assert calls == ["a"]
    assert json.loads(cache.read_text())[autotune.machine_key()]["op"]["k"]["choice"] == "a"
    assert (cache.parent / "tuning.json.corrupt").exists()


def test_stale_entries_are_not_used(cache):
    """Another GPU or torch/triton version, or a cached choice no longer offered: re-tuned."""
    cache.write_text(json.dumps({"Some GPU | torch 0.1 | triton 0.1": {"op": {"k": {"choice": "a"}}},
                                 autotune.machine_key(): {"op": {"k2": {"choice": "gone"}}}}))
    calls = []
    assert autotune.pick("op", "k", {"a": named("a"), "b": named("b")},
                         fake_measure({"a": 5.0, "b": 1.0}, calls)) == "b"
    assert autotune.pick("op", "k2", {"a": named("a")}, fake_measure({"a": 1.0}, calls)) == "a"
    assert calls == ["a", "b", "a"]
    data = json.loads(cache.read_text())
    assert data["Some GPU | torch 0.1 | triton 0.1"]["op"]["k"]["choice"] == "a"   # left alone


def test_unwritable_cache_dir_is_not_fatal(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("OPSMATH_CACHE_DIR", str(blocker / "sub"))   # a directory under a file
    autotune._MEMORY.clear()
    assert autotune.pick("op", "k", {"a": named("a")}, fake_measure({"a": 1.0}, [])) == "a"


def test_attention_launch_uses_the_tuned_block_configuration(cache):
    """A choice ``opsmath:BMxBNwWsS`` stored by the tuner is what the kernel launches with."""
    import torch
    from opsmath.kernels.attention.configs import launch_cfg as _launch_cfg
    from opsmath.kernels.attention.tuning import config_name, forced_config
    q = torch.empty(2, 4, 100, 64)
    autotune.store("attention", "k", dict(choice=config_name((128, 32, 8, 2))))
    assert _launch_cfg(q, 64, "k") == (128, 32, 64, 8, 2)
    autotune.store("attention", "k2", dict(choice="sdpa_cudnn"))
    assert _launch_cfg(q, 64, "k2") == (16, 16, 64, 4, 1)       # CPU default when opsmath was not chosen
    with forced_config((64, 32, 4, 3)):
        assert _launch_cfg(q, 64, "k") == (64, 32, 64, 4, 3)   # the tuner measuring a candidate


def test_attention_launch_uses_each_kernels_tuned_tiles(cache):
    """Per-kernel tiles (op ``attention_tiles``) stored beside an opsmath choice: each launch reads its own
    kernel's; beside a vendor choice they are not read; a forced dict gives each kernel its own."""
    import torch
    from opsmath.kernels.attention.configs import (TILES, config_name, fastest_tiles, forced_config, launch_cfg,
                                                   parse_tiles, tiles_name)
    tiles = {"fwd": (64, 32, 4, 2), "dq": (64, 64, 4, 1), "dkdv": (128, 64, 8, 1)}
    assert parse_tiles(tiles_name(tiles)) == tiles
    assert parse_tiles(config_name((64, 32, 4, 2))) is None and parse_tiles("sdpa_cudnn") is None
    q = torch.empty(1, 2, 50, 256)
    autotune.store("attention", "k own-only", dict(choice="opsmath"))
    autotune.store(TILES, "k own-only", dict(choice=tiles_name(tiles)))
    assert [launch_cfg(q, 256, "k", n) for n in tiles] == [(*c[:2], 256, *c[2:]) for c in tiles.values()]
    autotune.store("attention", "v", dict(choice="sdpa_cudnn"))
    autotune.store(TILES, "v", dict(choice=tiles_name(tiles)))
    assert launch_cfg(q, 256, "v", "dkdv") == (16, 16, 256, 4, 1)   # the vendor runs: the CPU default
    with forced_config({"fwd": (32, 16, 4, 1), "dq": (16, 32, 4, 1), "dkdv": (16, 16, 4, 1)}):
        assert launch_cfg(q, 256, "k", "dq") == (16, 32, 256, 4, 1)
    a, b = (64, 32, 4, 2), (128, 64, 8, 1)   # each kernel's fastest configuration, by its own time
    per = {a: {"_attn_fwd": 1.0, "_attn_bwd_dq": 2.0, "_attn_bwd_dkdv": 4.0},
           b: {"_attn_fwd": 1.5, "_attn_bwd_dq": 1.9, "_attn_bwd_dkdv": 3.0}, (16, 16, 4, 1): {"_attn_fwd": 0.1}}
    assert fastest_tiles(per) == {"fwd": a, "dq": b, "dkdv": b}
    assert fastest_tiles({(16, 16, 4, 1): {"_attn_fwd": 0.1}}) is None


def test_row_kernel_configuration_is_measured_once_per_shape_bucket(cache, monkeypatch):
    """``kernels._common.tuned_config``: every candidate launched and timed on a GPU, the winner cached;
    the default on CPU, and the cached choice (never a measurement) during CUDA graph capture."""
    import torch

    from opsmath.kernels._common import tuned_config
    launched, timed = [], []
    real_pick = autotune.pick

    def measure(fn):
        fn()
        timed.append(launched[-1])
        return {"a": 3.0, "b": 1.0, "c": 2.0}[launched[-1]]
    def pick(op, key, cands, sync=True):
        assert not sync   # never a collective at a kernel's first launch
        return real_pick(op, key, cands, measure, sync=sync)
    from opsmath.kernels import _common
    monkeypatch.setattr(_common, "pick", pick)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    configs = {"a": (1, 4), "b": (2, 8), "c": (4, 8)}
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert tuned_config("op_fwd", "bf16 N=768", configs, launched.append, cpu) == (1, 4)
    assert launched == []
    run = lambda cfg: launched.append({v: k for k, v in configs.items()}[cfg])  # noqa: E731
    assert tuned_config("op_fwd", "bf16 N=768", configs, run, gpu) == (2, 8)
    assert timed == ["a", "b", "c"]
    assert tuned_config("op_fwd", "bf16 N=768", configs, run, gpu) == (2, 8)
    assert timed == ["a", "b", "c"]   # remembered
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tuned_config("op_fwd", "bf16 N=768", configs, run, gpu) == (2, 8)
    assert tuned_config("op_fwd", "bf16 N=1024", configs, run, gpu) == (1, 4)   # never tuned: the default
    assert timed == ["a", "b", "c"]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("OPSMATH_TUNE_KERNELS", "0")
    assert tuned_config("op_fwd", "bf16 N=4096", configs, run, gpu) == (1, 4)
    assert timed == ["a", "b", "c"]
    assert tuned_config("op_fwd", "any", {"only": (1, 1)}, run, gpu) == (1, 1)   # one candidate: nothing to time


def test_candidates_are_ranked_by_kernel_time_not_launch_time(monkeypatch):
    """``autotune.measure``: device (kernel) time per call from the profiler; wall time only when a
    profiler is already running (the user's) or reports no kernels."""
    import torch
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(autotune, "wall_ms", lambda fn, warmup_ms=10, rep_ms=40: 5.0)   # host-bound: ties
    kernels = {"k1": 0.25, "k2": 0.5}
    monkeypatch.setattr(autotune, "kernel_ms", lambda fn, calls: dict(kernels))
    monkeypatch.setattr(torch.autograd, "_profiler_enabled", lambda: False)
    assert autotune.measure(lambda: None) == 0.75
    kernels.clear()
    assert autotune.measure(lambda: None) == 5.0
    kernels["k1"] = 0.25
    monkeypatch.setattr(torch.autograd, "_profiler_enabled", lambda: True)
    assert autotune.measure(lambda: None) == 5.0
    assert autotune.machine_key().endswith("| kernel time")   # choices ranked by wall time are not reused


def test_row_kernel_tuning_failure_falls_back_to_the_default(cache, monkeypatch):
    import torch

    from opsmath.kernels._common import tuned_config
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def broken(op, key, cands, sync=True):
        raise RuntimeError("every candidate failed")
    from opsmath.kernels import _common
    monkeypatch.setattr(_common, "pick", broken)
    assert tuned_config("op_bwd", "k", {"a": 1, "b": 2}, lambda c: None, torch.device("cuda")) == 1


def test_pick_skips_candidates_that_cannot_win(cache):
    """The attention tuner's skip rule: opsmath's other block configurations are not compiled or timed
    once its default took 1.5x the best vendor kernel's time; they are when it is close."""
    from opsmath.kernels.attention.tuning import own_configs_cannot_win
    order = ["sdpa_cudnn", "sdpa_flash", "opsmath", "opsmath:128x64w8s3", "opsmath:64x32w4s3"]
    for own, expect_measured in ((1.2, order[:3]), (0.8, order)):
        calls = []
        times = {"sdpa_cudnn": 0.6, "sdpa_flash": 1.1, "opsmath": own, "opsmath:128x64w8s3": 0.7,
                 "opsmath:64x32w4s3": 1.0}
        choice = autotune.pick("attention", f"k{own}", {n: named(n) for n in order}, fake_measure(times, calls),
                               skip=own_configs_cannot_win)
        assert calls == expect_measured and choice == "sdpa_cudnn"
    entry = autotune.lookup("attention", "k1.2")
    assert entry["skipped"] == order[3:] and set(entry["ms"]) == set(order[:3])
    assert not own_configs_cannot_win("opsmath:128x64w8s3", {"opsmath": 9.0})   # own-only tuning: no vendor


def test_plain_attention_never_compiles_opsmaths_kernel_beside_cudnn_or_flash(cache):
    """Plain attention: once cuDNN or flash measured accurate, no configuration of opsmath's kernel is
    compiled or timed; with only the efficient backend, or with a bias, mask, window or softcap, it is."""
    from opsmath.kernels.attention.tuning import own_configs_cannot_win
    order = ["sdpa_flash", "opsmath", "opsmath:128x64w8s3"]
    times = {"sdpa_flash": 1.0, "opsmath": 0.9, "opsmath:128x64w8s3": 0.8}
    for plain, expect_measured, expect in ((True, order[:1], "sdpa_flash"), (False, order, "opsmath:128x64w8s3")):
        calls = []
        choice = autotune.pick("attention", f"plain{plain}", {n: named(n) for n in order}, fake_measure(times, calls),
                               skip=lambda n, t: own_configs_cannot_win(n, t, plain))
        assert calls == expect_measured and choice == expect
    assert not own_configs_cannot_win("opsmath", {"sdpa_efficient": 1.0}, plain=True)
    assert not own_configs_cannot_win("opsmath", {}, plain=True)                  # own-only tuning
