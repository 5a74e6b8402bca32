"""opsmath::attention with a sliding window: key blocks left of the window are skipped in the forward,
dK/dV and dQ kernels, blocks across its edge are tested per entry. Compared with eager attention (the
window as a ``-inf`` mask) by docs/design.md's rule, under several block shapes, odd lengths, GQA,
dropout, a bias with its gradient (zeros written for the skipped blocks) and windows from 1 key to
more than the sequence."""
import math

import pytest
import torch
import torch.nn.functional as F

from opsmath.kernels.attention import attention_op
from opsmath.kernels.attention.configs import forced_config
from opsmath.kernels.attention.tuning import eager_same_dtype, fold_bias
from tolerance import assert_rule

from conftest import DEVICE

CASES = [  # B, H, Hkv, S, D, window, causal, bias, p
    (1, 2, 1, 37, 16, 1, True, False, 0.0),
    (2, 2, 2, 45, 16, 7, True, False, 0.0),
    (1, 4, 2, 53, 8, 16, True, True, 0.0),
    (1, 2, 2, 40, 16, 23, True, False, 0.2),
    (1, 2, 2, 33, 16, 50, True, False, 0.0),
    (1, 2, 1, 41, 16, 9, False, True, 0.0),
]
# on the GPU each flag combination and configuration compiles for ~10 s: the default and a BM != BN one
CONFIGS = [(16, 16, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1)] if DEVICE != "cuda" else [(64, 64, 4, 2), (128, 64, 8, 3)]


def _run(fn, q, k, v, bias, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    b = bias.detach().clone().requires_grad_() if bias is not None else None
    out = fn(q, k, v, b)
    out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1], device=out.device, dtype=out.dtype))
    return [out.detach(), q.grad, k.grad, v.grad] + ([b.grad] if b is not None else [])


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_window_matches_eager(case, cfg, triton_on_cpu, device):
    B, H, Hkv, S, D, window, causal, has_bias, p = case
    if DEVICE == "cuda":
        S, D = S * 7, D * 4
        window *= 7
    torch.manual_seed(S + window)
    q, k, v = torch.randn(B, H, S, D, device=device), torch.randn(B, Hkv, S, D, device=device), \
        torch.randn(B, Hkv, S, D, device=device)
    bias = torch.randn(1, H, S, S, device=device) if has_bias else None
    scale, seed = 1 / math.sqrt(D), torch.tensor(5)

    def fused(q, k, v, b):
        with forced_config(cfg):
            return attention_op(q, k, v, b, None, float("-inf"), causal, scale, p, seed, 0.0, window)[0]

    def eager(q, k, v, b):
        return eager_same_dtype(q, k, v, b, None, float("-inf"), causal, scale, p, 5, window=window)

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    got, same, ref = _run(fused, q, k, v, bias, dtype), _run(eager, q, k, v, bias, dtype), \
        _run(eager, q, k, v, bias, torch.float64)
    for name, f, e, r in zip(["out", "dq", "dk", "dv", "dbias"], got, same, ref):
        assert_rule(f, e, r, atol=1e-5 if dtype == torch.float32 else 2e-3, name=f"{name} {cfg}")


def test_window_folds_into_the_sdpa_bias():
    """SDPA gets the window as ``-inf`` entries left of it, with the causal triangle and a mask."""
    mask = torch.zeros(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 0] = True
    vb = fold_bias(None, mask, True, 6, 6, window=2)
    keep = torch.isfinite(vb[0, 0])
    i, j = torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij")
    assert torch.equal(keep, (j <= i) & (j > i - 2) & (j != 0))
    assert torch.equal(torch.isfinite(fold_bias(None, None, False, 4, 4, window=3)),
                       torch.ones(4, 4, dtype=torch.bool).tril(-3).logical_not())


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_rows_with_no_visible_key_are_zero_as_in_sdpa(path, request, device):
    """Padding after the window's last real key leaves rows with every key -inf: SDPA returns 0 there
    (and passes no gradient); so do the kernel and the reference, instead of NaN poisoning dK/dV."""
    if path == "triton":
        request.getfixturevalue("triton_on_cpu")
    elif device == "cuda":
        pytest.skip("CUDA tensors always take the Triton path")
    torch.manual_seed(3)
    S, w = 21, 3
    q, k, v = (torch.randn(2, 2, S, 16, device=device, requires_grad=True) for _ in range(3))
    pad = torch.zeros(2, 1, 1, S, dtype=torch.bool, device=device)
    pad[1, ..., 9:] = True                        # batch 1: keys 9.. are padding; rows 11.. see none
    i = torch.arange(S, device=device)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w) & ~pad
    do = torch.randn(2, 2, S, 16, device=device)
    got = attention_op(q, k, v, None, pad, float("-inf"), True, 0.25, 0.0, None, 0.0, w)[0]
    grads = torch.autograd.grad(got, (q, k, v), do)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.25)
    wgrads = torch.autograd.grad(want, (q, k, v), do)
    assert torch.equal(got[1, :, 11:], torch.zeros_like(got[1, :, 11:]))
    for a, b in zip((got, *grads), (want, *wgrads)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_sdpa_stand_in_keeps_dead_rows_zero_and_finite_fills_uniform(monkeypatch):
    """The vendor stand-in gets the folded bias: -inf entries stay -inf (a row with no visible key is 0,
    as opsmath's kernel), finite fills are clamped into the dtype (uniform rows, as eager's)."""
    from torch.nn.attention import SDPBackend
    from opsmath.kernels.attention import tuning as attention_tuning
    from opsmath.kernels.attention.tuning import sdpa
    monkeypatch.setitem(attention_tuning.BACKENDS, "sdpa_math", SDPBackend.MATH)   # CPU: the math path
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 6, 8, dtype=torch.bfloat16) for _ in range(3))
    dead = torch.zeros(1, 1, 6, 6)
    dead[..., 2, :] = float("-inf")
    assert torch.equal(sdpa(q, k, v, dead, False, 0.3, 0.0, "sdpa_math")[0, 0, 2], torch.zeros(8, dtype=q.dtype))
    fill = torch.zeros(1, 1, 6, 6).masked_fill(dead.isinf(), torch.finfo(torch.float32).min)
    row = sdpa(q, k, v, fill, False, 0.3, 0.0, "sdpa_math")[0, 0, 2].float()
    torch.testing.assert_close(row, v[0, 0].float().mean(0), rtol=2e-2, atol=2e-2)
