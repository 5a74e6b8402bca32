"""opsmath::attention kernel: Triton (interpreter on CPU, compiled on CUDA) vs PyTorch, docs/design.md rule."""
import math

import pytest
import torch

from opsmath.kernels._common import dropout_keep
from opsmath.kernels.attention import attention_op, attention_reference
from opsmath.kernels.attention.configs import CONFIGS, forced_config
from opsmath.kernels.attention.tuning import eager_same_dtype
from tolerance import assert_rule

from conftest import DEVICE


# Attention as users write it, in the inputs' dtype, with the kernel's dropout mask (the same function
# the tuner's accuracy check uses as its yardstick).
eager_attention = eager_same_dtype


CASES = [  # B, H, Hkv, Sq, Sk, D, bias, mask, causal, p
    (1, 2, 2, 17, 17, 16, None, None, False, 0.0),
    (2, 4, 2, 19, 23, 20, "head", "full", False, 0.0),
    (1, 2, 1, 33, 33, 16, None, None, True, 0.0),
    (1, 3, 3, 21, 21, 24, "grad", None, True, 0.2),
    (2, 2, 2, 9, 40, 8, None, "padding", True, 0.0),
    (2, 4, 4, 31, 31, 32, "padding", None, False, 0.1),
    (2, 4, 2, 37, 37, 16, "alibi", None, True, 0.0),   # per-key bias (B, H, 1, Sk), with its gradient
]
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
PAIRS = [(c, dt) for c in CASES for dt in DTYPES]
if DEVICE == "cuda":  # head dims and sizes that only a GPU runs in reasonable time: bf16, as trained
    PAIRS += [((2, 8, 2, 257, 257, d, None, None, True, 0.0), torch.bfloat16) for d in (32, 64, 80, 96, 128, 256)]
    PAIRS += [((2, 8, 8, 1000, 1000, 64, "padding", None, False, 0.1), torch.bfloat16),
              ((1, 16, 4, 2048, 2048, 128, None, None, True, 0.1), torch.bfloat16)]


def _inputs(case, dtype, device):
    B, H, Hkv, Sq, Sk, D, bias_kind, mask_kind, causal, p = case
    g = lambda *s: torch.randn(*s, device=device, dtype=dtype)  # noqa: E731
    q, k, v = g(B, H, Sq, D), g(B, Hkv, Sk, D), g(B, Hkv, Sk, D)
    bias = mask = None
    if bias_kind == "head":
        bias = torch.randn(B, 1, Sq, Sk, device=device)
    elif bias_kind == "grad":
        bias = torch.randn(1, H, Sq, Sk, device=device, requires_grad=True)
    elif bias_kind == "alibi":   # BLOOM's ALiBi: slope_h * j, one row per head broadcast over queries
        slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=device) / H)
        bias = (slopes[:, None] * torch.arange(Sk, device=device)).expand(B, H, Sk)[:, :, None].clone()
        bias.requires_grad_()
    elif bias_kind == "padding":  # HF-style additive padding mask
        keep = torch.rand(B, 1, 1, Sk, device=device) > 0.3
        keep[..., 0] = True
        bias = torch.zeros(B, 1, 1, Sk, device=device).masked_fill(~keep, torch.finfo(torch.float32).min)
    if mask_kind == "full":
        mask = torch.rand(B, H, Sq, Sk, device=device) < 0.2
    elif mask_kind == "padding":
        mask = torch.rand(B, 1, 1, Sk, device=device) < 0.3
        mask[..., 0] = False
    return q, k, v, bias, mask, -1e4, causal, 1 / math.sqrt(D), p, 1234  # a finite fill every dtype holds


def _run(fn, args, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in args[:3])
    b = args[3]
    if b is not None:
        b = b.detach().clone().requires_grad_(args[3].requires_grad)
    out = fn(q, k, v, b, *args[4:])
    do = torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1], device=out.device, dtype=out.dtype)
    out.backward(do)
    grads = [q.grad, k.grad, v.grad] + ([b.grad] if b is not None and b.requires_grad else [])
    return [out.detach()] + grads


def _fused(q, k, v, bias, mask, fill, causal, scale, p, seed):
    return attention_op(q, k, v, bias, mask, fill, causal, scale, p, torch.tensor(seed))[0]


@pytest.mark.parametrize("case,dtype", PAIRS, ids=str)
def test_triton_matches_eager(case, dtype, triton_on_cpu, device):
    torch.manual_seed(hash(case) % 1000)
    args = _inputs(case, torch.float32, device)
    fused = _run(_fused, args, dtype)
    eager = _run(eager_attention, args, dtype)
    ref = _run(eager_attention, args, torch.float64)
    atol = 1e-5 if dtype == torch.float32 else 2e-3
    for name, f, e, r in zip(["out", "dq", "dk", "dv", "dbias"], fused, eager, ref):
        assert_rule(f, e, r, atol=atol, name=f"{name} {dtype}")


TUNED = [(32, 16, 4, 1), (16, 32, 4, 1)] if DEVICE != "cuda" else sorted({c for cs in CONFIGS.values() for c in cs})
# each kernel its own configuration (the tuner's per-kernel tiles): the dK/dV blocks then differ from dQ's
TUNED += [{"fwd": (16, 32, 4, 1), "dq": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1)}] if DEVICE != "cuda" else \
    [{"fwd": (64, 32, 4, 2), "dq": (64, 32, 4, 1), "dkdv": (128, 64, 8, 1)}]


@pytest.mark.parametrize("cfg", TUNED, ids=str)
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4]], ids=str)
def test_every_block_configuration_matches_eager(case, cfg, triton_on_cpu, device):
    """The tuner may launch any configuration: BLOCK_M != BLOCK_N, odd lengths, causal block skipping,
    dropout, GQA and masks must stay exact under each (on CPU: small non-square blocks)."""
    torch.manual_seed(1)
    args = _inputs(case, torch.float32, device)
    with forced_config(cfg):
        fused = _run(_fused, args, torch.float32)
    eager = _run(eager_attention, args, torch.float32)
    ref = _run(eager_attention, args, torch.float64)
    for name, f, e, r in zip(["out", "dq", "dk", "dv", "dbias"], fused, eager, ref):
        assert_rule(f, e, r, atol=1e-5, name=f"{name} {cfg}")


@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_reference_matches_autograd(case):
    """The CPU reference (explicit backward math) against autograd through eager attention, fp64."""
    torch.manual_seed(0)
    args = _inputs(case, torch.float64, "cpu")
    fused = _run(_fused, args, torch.float64)
    ref = _run(eager_attention, args, torch.float64)
    for f, r in zip(fused, ref):
        torch.testing.assert_close(f.double(), r.double(), rtol=1e-9, atol=1e-9)


def test_fully_masked_finite_fill_rows_are_uniform(triton_on_cpu, device):
    """Rows whose every key carries a finite fill (finfo.min) get uniform weights, as eager's softmax."""
    q, k, v = (torch.randn(1, 1, 8, 16, device=device) for _ in range(3))
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool, device=device)
    mask[..., 3, :] = True
    fill = torch.finfo(torch.float32).min
    out = _fused(q, k, v, None, mask, fill, False, 0.25, 0.0, 0)
    eager = eager_attention(q, k, v, None, mask, fill, False, 0.25, 0.0, 0)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0, 0, 3], v[0, 0].mean(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_rows_of_finite_fill_biases_have_the_gradient_of_their_function(path, request, device):
    """A row whose every key carries finfo.min in an additive bias (HF's padding mask: a left-padded query):
    its weights are uniform and its gradients those of softmax(S + b) V written out, within the tolerance
    rule of the fp64 chain. (PyTorch's SDPA backward is off by about the key count there: its log-sum-exp
    m + log(l) rounds to m at |m| ~ 3e38, so it recomputes P as 1 per key; measured relative errors of
    1.7-3.0 on dQ/dK/dV against fp64. opsmath keeps m and log(l) apart.)"""
    if path == "triton":
        request.getfixturevalue("triton_on_cpu")
    elif device == "cuda":
        pytest.skip("CUDA tensors always take the Triton path")
    torch.manual_seed(0)
    bias = torch.randn(1, 1, 9, 9, device=device) * 0.1
    bias[..., 0, :] = torch.finfo(torch.float32).min
    args = (torch.randn(1, 2, 9, 16, device=device), torch.randn(1, 2, 9, 16, device=device),
            torch.randn(1, 2, 9, 16, device=device), bias, None, float("-inf"), False, 0.3, 0.0, 1)
    fused = _run(_fused, args, torch.float32)
    eager = _run(eager_attention, args, torch.float32)
    ref = _run(eager_attention, args, torch.float64)
    for name, f, e, r in zip(["out", "dq", "dk", "dv"], fused, eager, ref):
        assert_rule(f, e, r, atol=1e-5, name=name)
    assert fused[1][0, :, 0].abs().max() > 0   # the row's own dQ is not dropped


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_fraction(p, triton_on_cpu, device):
    """With Q = K = 0 every probability is 1/Sk and V = 1 makes each output the kept fraction / (1 - p)."""
    B, H, S, D = 2, 2, 64, 16
    Sk = 512
    q = torch.zeros(B, H, S, D, device=device)
    k = torch.zeros(B, H, Sk, D, device=device)
    v = torch.ones(B, H, Sk, D, device=device)
    out = _fused(q, k, v, None, None, 0.0, False, 1.0, p, 99)
    kept = (out[..., 0] * (1 - p)).mean().item()
    assert abs((1 - kept) - p) <= 0.01
    # and a different seed draws a different mask
    out2 = _fused(q, k, v, None, None, 0.0, False, 1.0, p, 100)
    assert not torch.equal(out, out2)


def test_hash_rng_fraction():
    for p in (0.1, 0.3, 0.5):
        keep = dropout_keep(7, torch.arange(1_000_000), p)
        assert abs((1 - keep.float().mean().item()) - p) < 0.01


def test_int64_offsets_in_rng():
    """Offsets past 2**32 still give independent masks (the high word feeds the key)."""
    lo = dropout_keep(3, torch.arange(100_000), 0.5)
    hi = dropout_keep(3, torch.arange(100_000) + 2**32, 0.5)
    assert (lo != hi).float().mean().item() > 0.4


def test_opcheck_reference():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    bias = torch.randn(1, 1, 5, 5)
    args = (q, k, v, bias, None, float("-inf"), True, 0.3, 0.0, torch.tensor(0))
    torch.library.opcheck(torch.ops.opsmath.attention.default, args)


def test_opcheck_triton(triton_on_cpu):
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    args = (q, k, v, None, None, float("-inf"), False, 0.3, 0.25, torch.tensor(5))
    torch.library.opcheck(torch.ops.opsmath.attention.default, args)


def test_reference_forward_is_exact_fp32():
    q, k, v = (torch.randn(2, 2, 7, 8) for _ in range(3))
    out, stats = attention_reference(q, k, v, None, None, 0.0, False, 0.5, 0.0, 0)
    eager = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ v
    torch.testing.assert_close(out, eager)
    assert stats.shape == (2, 2, 7, 2)


def _softcapped_eager(cap):
    """Eager attention with Gemma-2's softcap (scores * scaling, / softcap, tanh, * softcap)."""
    return lambda *a: eager_attention(*a, softcap=cap)


SOFTCAP_CASES = [  # odd sizes, GQA, causal, bias with gradient, padding mask; caps that bite (scores ~ cap)
    ((1, 2, 2, 17, 17, 16, None, None, False, 0.0), 1.5),
    ((2, 4, 2, 19, 23, 20, "grad", "full", False, 0.0), 2.0),
    ((1, 3, 1, 33, 33, 24, "padding", None, True, 0.0), 0.7),
]


@pytest.mark.parametrize("case,cap", SOFTCAP_CASES, ids=str)
def test_softcap_matches_eager(case, cap, triton_on_cpu, device):
    """``S = softcap * tanh(scale QK^T / softcap)`` before bias and masks, forward and every gradient
    (dbias is taken after the cap, dQ/dK through tanh'), by the tolerance rule."""
    torch.manual_seed(hash(case) % 1000)
    args = _inputs(case, torch.float32, device)
    args = (*args[:7], 1.0, *args[8:])   # unit scale: scores of a few units, where tanh saturates
    fused = _run(lambda *a: attention_op(*a[:9], torch.tensor(a[9]), cap)[0], args, torch.float32)
    eager = _run(_softcapped_eager(cap), args, torch.float32)
    ref = _run(_softcapped_eager(cap), args, torch.float64)
    for name, f, e, r in zip(["out", "dq", "dk", "dv", "dbias"], fused, eager, ref):
        assert_rule(f, e, r, atol=1e-5, name=f"{name} softcap={cap}")
    assert (fused[0] - _run(eager_attention, args, torch.float32)[0]).abs().max() > 1e-3   # the cap acted


@pytest.mark.parametrize("case,cap", SOFTCAP_CASES[1:], ids=str)
def test_softcap_reference_matches_autograd(case, cap):
    """The CPU reference's explicit softcap backward against autograd through Gemma-2's spelling, fp64."""
    torch.manual_seed(0)
    args = _inputs(case, torch.float64, "cpu")
    fused = _run(lambda *a: attention_op(*a[:9], torch.tensor(a[9]), cap)[0], args, torch.float64)
    ref = _run(_softcapped_eager(cap), args, torch.float64)
    for f, r in zip(fused, ref):   # dbias is held in the bias's fp32
        tol = 1e-9 if f.dtype == torch.float64 else 1e-6
        torch.testing.assert_close(f.double(), r.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("cfg", [*CONFIGS[256][:2], {"fwd": (64, 32, 4, 2), "dq": (64, 32, 4, 1),
                                                     "dkdv": (128, 64, 8, 1)}], ids=str)
def test_wide_head_tiles_match_eager_with_a_softcap(cfg, triton_on_cpu, device):
    """Head dim 200 (padded to 256) in the tuner's D256 tiles (the default, the 128 x 64 tiles the H200
    picks, and the per-kernel tiles it measured fastest), causal with a softcap, GQA and odd lengths
    across several key blocks: forward and every gradient by the tolerance rule."""
    torch.manual_seed(5)
    args = _inputs((1, 2, 1, 131, 131, 200, None, None, True, 0.0), torch.float32, device)
    args = (*args[:7], 1.0, *args[8:])
    with forced_config(cfg):
        fused = _run(lambda *a: attention_op(*a[:9], torch.tensor(a[9]), 2.0)[0], args, torch.float32)
    eager = _run(_softcapped_eager(2.0), args, torch.float32)
    ref = _run(_softcapped_eager(2.0), args, torch.float64)
    for name, f, e, r in zip(["out", "dq", "dk", "dv"], fused, eager, ref):
        assert_rule(f, e, r, atol=1e-5, name=f"{name} {cfg}")


@pytest.mark.parametrize("setting", ["new_api_tf32", "new_api_ieee", "legacy_tf32", "global_tf32"])
def test_tf32_setting_read_from_either_api(setting):
    """HF Trainer / Accelerate set TF32 through the new API; reading the legacy ``allow_tf32`` then raises
    (the attention kernel's launch did, under ``Trainer(bf16=True)``). Either spelling is read."""
    from opsmath.kernels._common import tf32_matmuls
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("torch without the fp32_precision API")
    want = setting != "new_api_ieee"
    try:
        if setting == "legacy_tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
        elif setting == "global_tf32":
            torch.backends.fp32_precision = "tf32"
        else:
            torch.backends.cuda.matmul.fp32_precision = "tf32"
            torch.backends.cuda.matmul.fp32_precision = "tf32" if want else "ieee"
        assert tf32_matmuls() is want
    finally:   # the legacy write sets the matmul precision ("ieee"): reset it first
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.fp32_precision = "none"
        torch.backends.cuda.matmul.fp32_precision = "none"
    assert tf32_matmuls() is False and torch.backends.cuda.matmul.allow_tf32 is False
