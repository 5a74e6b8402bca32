"""The attention rewrite's vendor choice (``src/opsmath/kernels/attention/tuning.py``): SDPA backends compute
``opsmath::attention``'s function once masks, causal and GQA are translated; CUDA parts skip on CPU."""
import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from opsmath.kernels.attention import tuning as vendor
from opsmath.kernels.attention import attention_reference
from tolerance import assert_rule

from conftest import DEVICE

CASES = [  # B, H, Hkv, Sq, Sk, D, bias, mask, causal
    (2, 4, 4, 17, 17, 16, None, None, True),
    (2, 4, 2, 19, 23, 8, "head", None, False),
    (1, 4, 1, 21, 21, 16, "padding", "padding", True),
    (2, 2, 2, 9, 40, 8, None, "full", False),
    (1, 2, 2, 33, 33, 32, "head", "full", True),
]


def inputs(case, dtype, device):
    B, H, Hkv, Sq, Sk, D, bias_kind, mask_kind, causal = case
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, h, s, D, device=device, dtype=dtype) for h, s in ((H, Sq), (Hkv, Sk), (Hkv, Sk)))
    bias = mask = None
    if bias_kind == "head":
        bias = torch.randn(B, 1, Sq, Sk, device=device, dtype=dtype)
    elif bias_kind == "padding":   # HF-style additive mask with fp32's finfo.min
        keep = torch.rand(B, 1, 1, Sk, device=device) > 0.3
        keep[..., 0] = True
        bias = torch.zeros(B, 1, 1, Sk, device=device).masked_fill(~keep, torch.finfo(torch.float32).min)
    if mask_kind == "full":
        mask = torch.rand(B, H, Sq, Sk, device=device) < 0.2
        mask[..., 0] = False
    elif mask_kind == "padding":
        mask = torch.rand(B, 1, 1, Sk, device=device) < 0.3
        mask[..., 0] = False
    return q, k, v, bias, mask, causal, 1 / math.sqrt(D)


@pytest.mark.parametrize("case", CASES)
def test_folded_bias_gives_sdpa_the_same_function(case):
    """float64, SDPA's math backend (any device): fold_bias + is_causal + enable_gqa == ours."""
    q, k, v, bias, mask, causal, scale = inputs(case, torch.float64, "cpu")
    ref = attention_reference(q, k, v, bias, mask, float("-inf"), causal, scale, 0.0, 0)[0]
    vb = vendor.fold_bias(bias, mask, causal, q.shape[2], k.shape[2])
    with sdpa_kernel([SDPBackend.MATH]):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=vb, is_causal=causal and vb is None,
                                             scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_bucket_key_and_eligibility():
    q = torch.empty(3, 12, 1000, 64, dtype=torch.bfloat16)
    k = torch.empty(3, 4, 1000, 64, dtype=torch.bfloat16)
    key = vendor.bucket_key(q, k, False, True, True, 0.1)
    assert key == "bfloat16 D=64 H/Hkv=3 B*H<=64 Sq<=1024 Sk<=1024 causal=1 bias=0 mask=1 dropout=1"
    cuda = torch.device("cuda")
    assert vendor.vendor_eligible(cuda, float("-inf"), False)
    assert not vendor.vendor_eligible(cuda, -1e4, False)              # finite fill: uniform masked rows
    assert not vendor.vendor_eligible(cuda, float("-inf"), True)      # a bias that needs its gradient
    assert not vendor.vendor_eligible(torch.device("cpu"), float("-inf"), False)


cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="SDPA's flash/cuDNN/efficient backends need CUDA")


@cuda_only
@pytest.mark.parametrize("case", CASES + [(2, 16, 4, 1000, 1000, 128, None, None, True),
                                          (2, 8, 8, 517, 517, 64, "padding", None, False)])
def test_the_chosen_kernel_follows_the_tolerance_rule(case, tmp_path, monkeypatch):
    """Whatever ``choose`` picks (vendors are admitted only after their own accuracy check on a
    slice) meets docs/design.md's rule on the whole problem: output and every gradient."""
    from opsmath.kernels import autotune
    from opsmath.kernels.attention import attention_op
    monkeypatch.setenv("OPSMATH_CACHE_DIR", str(tmp_path))
    autotune._MEMORY.clear()
    q, k, v, bias, mask, causal, scale = inputs(case, torch.bfloat16, "cuda")
    choice = vendor.choose(q.shape, k.shape, q.dtype, q.device, None if bias is None else bias.shape,
                           None if mask is None else mask.shape, float("-inf"), causal, scale, 0.0)
    args = [t.detach().requires_grad_() for t in (q, k, v)]
    if choice == "opsmath":
        out = attention_op(*args, bias, mask, float("-inf"), causal, scale, 0.0, torch.tensor(0))[0]
    else:
        vb = vendor.fold_bias(bias, mask, causal, q.shape[2], k.shape[2])
        out = vendor.sdpa(*args, vb, causal and vb is None, scale, 0.0, choice)
    do = torch.randn_like(out)
    out.backward(do)
    res = {}
    for name, dt in (("ref", torch.float64), ("eager", torch.bfloat16)):
        a = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        if name == "ref":
            o = attention_reference(*a, bias, mask, float("-inf"), causal, scale, 0.0, 0)[0]
        else:
            o = vendor.eager_same_dtype(*a, bias, mask, float("-inf"), causal, scale)
        o.backward(do.to(dt))
        res[name] = [o.detach()] + [t.grad for t in a]
    for i, name in enumerate(["out", "dq", "dk", "dv"]):
        got = out.detach() if i == 0 else args[i - 1].grad
        assert_rule(got, res["eager"][i], res["ref"][i], atol=1e-3, name=f"{choice} {name}")


@cuda_only
def test_choose_measures_and_caches(tmp_path, monkeypatch):
    from opsmath.kernels import autotune
    monkeypatch.setenv("OPSMATH_CACHE_DIR", str(tmp_path))
    autotune._MEMORY.clear()
    args = ((4, 16, 1024, 64), (4, 16, 1024, 64), torch.bfloat16, torch.device("cuda"), None, None,
            float("-inf"), True, 0.125, 0.0)
    choice = vendor.choose(*args)
    assert choice in {"opsmath", *vendor.BACKENDS}
    entry = autotune.lookup("attention", vendor.bucket_key(torch.empty(4, 16, 1024, 64, dtype=torch.bfloat16),
                                                           torch.empty(4, 16, 1024, 64), False, False, True, 0.0))
    assert entry["choice"] == choice and "opsmath" in entry["ms"] and len(entry["ms"]) >= 2


def test_accuracy_check_admits_exact_backends_and_rejects_wrong_ones(monkeypatch):
    """``accurate_backends`` on CPU, with stand-in backends: one computes the function, one is off
    by 1% in the output, one drops the gradient of K."""
    monkeypatch.setattr(vendor, "BACKENDS", {"exact": None, "noisy": None, "no_dk": None})
    q, k, v, bias, mask, causal, scale = inputs(CASES[2], torch.float32, "cpu")
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def run(name, q, k, v, bias, mask, vbias, p):
        if name == "eager":
            return vendor.eager_same_dtype(q, k, v, bias, mask, float("-inf"), causal, scale)
        if name == "no_dk":
            k = k.detach()
        out = attention_reference(q, k, v, bias, mask, float("-inf"), causal, scale, p, 0)[0]
        return out * 1.01 if name == "noisy" else out
    dout = torch.randn_like(q)
    assert vendor.accurate_backends(run, q, k, v, bias, mask, None, dout) == ["exact"]


def test_accuracy_check_runs_on_the_first_check_len_positions(monkeypatch):
    """The check's fp32 reference is T^2: past ``CHECK_LEN`` queries and keys it runs on the first ones
    (the causal structure anchored at 0 unchanged), bias and mask cut alike; a wrong backend still fails."""
    monkeypatch.setattr(vendor, "BACKENDS", {"exact": None, "noisy": None})
    monkeypatch.setattr(vendor, "CHECK_LEN", 8)
    q, k, v, bias, mask, causal, scale = inputs(CASES[4], torch.float32, "cpu")   # 33 positions, bias, mask
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    seen = []

    def run(name, q, k, v, bias, mask, vbias, p):
        seen.append((q.shape[-2], k.shape[-2], bias.shape[-2:], mask.shape[-2:]))
        if name == "eager":
            return vendor.eager_same_dtype(q, k, v, bias, mask, float("-inf"), causal, scale)
        out = attention_reference(q, k, v, bias, mask, float("-inf"), causal, scale, p, 0)[0]
        return out * 1.01 if name == "noisy" else out
    assert vendor.accurate_backends(run, q, k, v, bias, mask, None, torch.randn_like(q)) == ["exact"]
    assert set(seen) == {(8, 8, (8, 8), (8, 8))}


def test_choose_stores_each_kernels_fastest_configuration(tmp_path, monkeypatch, triton_on_cpu):
    """The tuner times each block configuration's three kernels (stand-in profiles here; every candidate
    still runs) and stores, beside its choice, each kernel's fastest configuration; launches read them."""
    from opsmath.kernels.attention import configs as ac
    from opsmath.kernels import autotune
    monkeypatch.setenv("OPSMATH_CACHE_DIR", str(tmp_path))
    autotune._MEMORY.clear()
    a, b, c, d = ac.CONFIGS[64]
    times = {a: (1.0, 2.0, 3.0), b: (0.9, 1.5, 3.1), c: (1.2, 2.5, 2.0), d: (0.5, 3.0, 3.5)}   # fwd, dq, dkdv
    seen = []
    enter = ac.forced_config.__enter__
    monkeypatch.setattr(ac.forced_config, "__enter__", lambda self: (seen.append(self.cfg), enter(self))[1])

    def profile(fn, *timing):   # measure_kernels(fn, warmup_ms, rep_ms)
        fn()   # the candidate runs (Triton's interpreter): a configuration that fails would fail here
        return dict(zip(ac.KERNELS.values(), times[seen[-1]]))
    monkeypatch.setattr(autotune, "measure_kernels", profile)
    q, k = torch.empty(1, 2, 40, 16), torch.empty(1, 2, 40, 16)
    assert vendor.choose(q.shape, k.shape, torch.float32, torch.device("cpu"), None, None, float("-inf"), True,
                         0.25, 0.0, vendors=False) == "opsmath"
    key = vendor.bucket_key(q, k, False, False, True, 0.0)
    assert autotune.lookup("attention", key + ac.OWN_ONLY)["choice"] == ac.config_name(b)   # best in sum: 5.5
    tiles = {"fwd": d, "dq": b, "dkdv": c}
    assert autotune.lookup(ac.TILES, key + ac.OWN_ONLY)["choice"] == ac.tiles_name(tiles)
    assert [ac.launch_cfg(q, 16, key, n) for n in ac.KERNELS] == [(*t[:2], 16, *t[2:]) for t in tiles.values()]


def test_compile_ahead_runs_each_kernel_and_configuration_in_its_own_thread(monkeypatch):
    """Before timing, the tuner compiles opsmath's three kernels in every block configuration at once, one
    thread per kernel and configuration: a thread's forced configuration is its own (the others' and the
    caller's launches do not see it), each launch makes only its kernel, and one that raises stops nothing.
    (Stand-ins for the Triton launches and for CUDA: the threading is what is checked.)"""
    import threading
    from types import SimpleNamespace
    from opsmath.kernels.attention import configs as ac
    seen = []
    x = torch.empty(1, 1, 8, 16)

    def forward(*args):
        cfg = ac.launch_cfg(x, 16)
        if cfg[:2] == (64, 32):
            raise RuntimeError("out of shared memory")
        seen.append(("fwd", threading.get_ident(), cfg))
        return x, x

    def backward(dout, q, k, v, out, stats, *rest, kernels):
        assert len(rest) == 10 and rest[7] is False   # bias, mask, ..., seed, bias_grad, softcap, window
        assert out.shape == x.shape and stats.shape == (1, 1, 8, 2) and len(kernels) == 1
        seen.append((kernels[0], threading.get_ident(), ac.launch_cfg(x, 16, kernel=kernels[0])))
    monkeypatch.setattr(vendor, "attention_forward_triton", forward)
    monkeypatch.setattr(vendor, "attention_backward_triton", backward)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(vendor, "_ahead_workers", lambda q, k, jobs: jobs)
    q = SimpleNamespace(device=torch.device("cuda"), shape=x.shape, dtype=x.dtype)
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: torch.empty(x.shape))
    monkeypatch.setattr(torch, "empty", lambda shape, **kw: torch.zeros(shape))
    configs = ac.CONFIGS[64]
    vendor.compile_ahead(configs, (q, None, None, None, None, float("-inf"), True, 0.125, 0.0, None, 0.0, 0), x)
    expect = {(kind, (*c[:2], 16, *c[2:])) for c in configs for kind in ("fwd", "dq", "dkdv")}
    expect -= {("fwd", (64, 32, 16, 4, 3))}   # the configuration whose forward raised
    assert {(kind, cfg) for kind, _, cfg in seen} == expect and len(seen) == len(expect)
    assert ac.launch_cfg(x, 16) == (16, 16, 16, 4, 1)   # the caller's thread: no forced configuration
    vendor.compile_ahead(configs, (SimpleNamespace(device=torch.device("cpu")),) + (None,) * 11, x)
    assert len(seen) == len(expect), "CPU: nothing compiled ahead"


@pytest.mark.parametrize("room_gib, workers", [(64.0, 2), (1.0, 1), (0.0, 1)])
def test_compile_ahead_threads_fit_the_memory_left(monkeypatch, room_gib, workers):
    """One thread per job, but no more than the CPUs, nor than a quarter of the memory the process may
    still allocate holds the launches' buffers for (T = 65536: about 0.5 GiB a thread here)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (int(room_gib * 2**30), 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: 1.0)
    monkeypatch.setattr(vendor.os, "cpu_count", lambda: 2)
    q = torch.empty(1, 12, 65536, 64, dtype=torch.bfloat16, device="meta")
    assert vendor._ahead_workers(q, q, 9) == workers


@pytest.mark.parametrize("default_ms, compiled", [(2.0, False), (1.2, True)])
def test_beside_a_vendor_other_configurations_compile_only_when_timed(default_ms, compiled, tmp_path, monkeypatch,
                                                                      triton_on_cpu):
    """A masked shape with an accurate vendor kernel: opsmath's default configuration is compiled ahead, the
    vendor is timed, then the default. Where the vendor beat it by ``OWN_CONFIG_GAIN`` the other
    configurations are neither timed nor compiled; else they are compiled (ahead, all at once) just before
    the first of them runs.
    (Stand-ins for the SDPA backend, the accuracy check and the profiles; the tuner's order is checked.)"""
    from opsmath.kernels.attention import configs as ac
    from opsmath.kernels import autotune
    monkeypatch.setenv("OPSMATH_CACHE_DIR", str(tmp_path))
    autotune._MEMORY.clear()
    events, seen = [], []
    enter = ac.forced_config.__enter__
    monkeypatch.setattr(ac.forced_config, "__enter__", lambda self: (seen.append(self.cfg), enter(self))[1])
    monkeypatch.setattr(vendor, "vendor_eligible", lambda *a: True)
    monkeypatch.setattr(vendor, "accurate_backends", lambda *a: ["sdpa_cudnn"])
    monkeypatch.setattr(vendor, "sdpa", lambda q, k, v, *a: F.scaled_dot_product_attention(q, k, v))
    monkeypatch.setattr(vendor, "compile_ahead", lambda configs, *a: events.append(("ahead", list(configs))))
    default = ac.CONFIGS[64][0]

    def profile(fn, *timing):
        fn()
        cfg = seen[-1]
        events.append(("timed", cfg))
        return {"k": 1.0 if cfg is None else default_ms if cfg == default else 1.5}
    monkeypatch.setattr(autotune, "measure_kernels", profile)
    q = torch.empty(1, 2, 24, 16)
    mask = (1, 1, 1, 24)
    choice = vendor.choose(q.shape, q.shape, torch.float32, torch.device("cpu"), None, mask, float("-inf"), False,
                           0.25, 0.0)
    assert choice == "sdpa_cudnn"
    others = ac.CONFIGS[64][1:]
    timed = [e[1] for e in events if e[0] == "timed"]
    assert events[0] == ("ahead", [default]) and timed[:2] == [None, default]   # the default: always timed
    if compiled:
        assert events[3] == ("ahead", others) and timed[2:] == others
    else:
        assert len(timed) == 2 and [e for e in events if e[0] == "ahead"] == [("ahead", [default])]


def test_compile_ahead_threads_when_memory_cannot_be_read(monkeypatch):
    """Where the device's memory cannot be read, one thread: the tuning itself goes on."""
    def unreadable(d=None):
        raise RuntimeError("no memory info")
    monkeypatch.setattr(torch.cuda, "mem_get_info", unreadable)
    q = torch.empty(1, 12, 1024, 64, dtype=torch.bfloat16, device="meta")
    assert vendor._ahead_workers(q, q, 9) == 1
