"""opsmath::linear_cross_entropy vs ``F.cross_entropy(F.linear(x, W, b), t)``: docs/design.md's rule against
float64, loss and dx/dW/db, odd sizes, several chunks, ignore_index, label smoothing, mean and sum;
the Triton row kernel through the interpreter on CPU."""
import pytest
import torch
import torch.nn.functional as F

from opsmath.kernels.linear_cross_entropy import (linear_cross_entropy, linear_cross_entropy_forward,
                                                  linear_cross_entropy_op)
from tolerance import assert_rule

from conftest import DEVICE

CASES = [  # N, C, V, bias, ignore, smoothing, reduction, chunk
    (37, 24, 101, False, False, 0.0, "mean", None),
    (150, 16, 257, True, True, 0.0, "mean", 64),
    (150, 16, 257, True, True, 0.1, "sum", 40),
    (65, 32, 5000, False, True, 0.05, "mean", 16),
]
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def make(case, dtype, device):
    N, C, V, bias, ignore, *_ = case
    torch.manual_seed(0)
    x = torch.randn(N, C, device=device, dtype=dtype)
    w = torch.randn(V, C, device=device, dtype=dtype) / C ** 0.5
    b = torch.randn(V, device=device, dtype=dtype) if bias else None
    t = torch.randint(0, V, (N,), device=device)
    if ignore:
        t[::3] = -100
    return x, w, b, t


def eager(x, w, b, t, smoothing, reduction, softcap=0.0):
    z = F.linear(x, w, b)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z.float(), t, label_smoothing=smoothing, reduction=reduction)


def grads_of(fn, x, w, b, dtype):
    xs = [a.detach().to(dtype).requires_grad_() if a is not None else None for a in (x, w, b)]
    loss = fn(*xs)
    loss.backward()
    return [loss.detach()] + [a.grad for a in xs if a is not None]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_matches_eager(case, dtype, path, softcap, request, monkeypatch):
    if path == "triton":
        request.getfixturevalue("triton_on_cpu")
    elif DEVICE == "cuda":
        pytest.skip("CUDA tensors always take the Triton path")
    *_, smoothing, reduction, chunk = case
    x, w, b, t = make(case, dtype, DEVICE)
    if chunk:  # force several chunks through the op, and dW accumulated in three row blocks
        monkeypatch.setattr("opsmath.kernels.linear_cross_entropy.chunk_rows", lambda V, N, *_: chunk)
        monkeypatch.setattr("opsmath.kernels.linear_cross_entropy.DW_BLOCK_MIN_ROWS", 1)
        monkeypatch.setattr("opsmath.kernels.linear_cross_entropy.DW_BLOCK_BYTES", 4 * x.shape[1] * -(-w.shape[0] // 3))
    fused = grads_of(lambda x, w, b: linear_cross_entropy(x, w, b, t, -100, smoothing, reduction, softcap),
                     x, w, b, dtype)
    ref = grads_of(lambda x, w, b: eager(x, w, b, t, smoothing, reduction, softcap), x, w, b, torch.float64)
    same = grads_of(lambda x, w, b: eager(x, w, b, t, smoothing, reduction, softcap), x, w, b, dtype)
    for name, f, e, r in zip(["loss", "dx", "dw", "db"], fused, same, ref):
        assert_rule(f, e, r, name=name)


def test_scales_by_the_incoming_gradient_and_eval_mode():
    x, w, b, t = make(CASES[1], torch.float32, DEVICE)
    xs = [a.clone().requires_grad_() for a in (x, w, b)]
    (3.0 * linear_cross_entropy(*xs, t)).backward()
    xr = [a.clone().requires_grad_() for a in (x, w, b)]
    (3.0 * eager(*xr, t, 0.0, "mean")).backward()
    for a, r in zip(xs, xr):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        loss, dx, dw, db, logits = linear_cross_entropy_op(x, w, b, t, -100, 0.0, "mean", False)
    assert logits.numel() == 0
    assert dx.numel() == dw.numel() == db.numel() == 0
    torch.testing.assert_close(loss, eager(x, w, b, t, 0.0, "mean"), rtol=1e-5, atol=1e-6)


def test_all_ignored_is_nan_like_torch_and_bad_reduction_raises():
    x, w, b, t = make(CASES[0], torch.float32, DEVICE)
    t[:] = -100
    loss = linear_cross_entropy_forward(x, w, b, t, -100, 0.0, "mean", False)[0]
    assert torch.isnan(loss) and torch.isnan(eager(x, w, b, t, 0.0, "mean"))
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy_op(x, w, b, t, -100, 0.0, "none", False)


@pytest.mark.parametrize("return_logits", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_opcheck(return_logits, softcap):
    x, w, b, t = make(CASES[1], torch.float32, DEVICE)
    x.requires_grad_()
    w.requires_grad_()
    torch.library.opcheck(linear_cross_entropy_op, (x, w, b, t, -100, 0.0, "mean", True, return_logits, softcap))


@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_returned_logits_and_their_own_gradient(path, softcap, request, monkeypatch):
    """With ``return_logits`` the op also returns the logits (each chunk's GEMM writes into them, G goes to
    a buffer of its own; three chunks here); a loss on them (here a z-loss) adds its gradient through x and
    W exactly as eager autograd does."""
    if path == "triton":
        request.getfixturevalue("triton_on_cpu")
    elif DEVICE == "cuda":
        pytest.skip("CUDA tensors always take the Triton path")
    x, w, b, t = make(CASES[1], torch.float32, DEVICE)
    monkeypatch.setattr("opsmath.kernels.linear_cross_entropy.chunk_rows", lambda V, N, *_: -(-N // 3))
    xs = [a.clone().requires_grad_() for a in (x, w, b)]
    loss, _, _, _, logits = linear_cross_entropy_op(*xs, t, -100, 0.0, "mean", True, True, softcap)
    (loss + 1e-2 * torch.logsumexp(logits, -1).pow(2).mean()).backward()
    xr = [a.clone().requires_grad_() for a in (x, w, b)]
    z = F.linear(*xr)
    z = softcap * torch.tanh(z / softcap) if softcap else z
    (F.cross_entropy(z, t) + 1e-2 * torch.logsumexp(z, -1).pow(2).mean()).backward()
    torch.testing.assert_close(loss, F.cross_entropy(z, t).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, z.detach(), rtol=1e-5, atol=1e-5)
    for a, r in zip(xs, xr):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("used", ["loss", "logits"])
def test_returned_logits_with_one_of_the_two_gradients(used, monkeypatch):
    """Gradients computed in backward from the returned logits (``grads_in_backward``) where only the loss
    (the returned logits unread, as a training loop leaves HF's) or only the logits carry a gradient."""
    x, w, b, t = make(CASES[2], torch.float32, DEVICE)
    monkeypatch.setattr("opsmath.kernels.linear_cross_entropy.chunk_rows", lambda V, N, *_: 64)
    xs = [a.clone().requires_grad_() for a in (x, w, b)]
    loss, *_, logits = linear_cross_entropy_op(*xs, t, -100, 0.1, "sum", True, True)
    (loss if used == "loss" else logits.pow(2).mean()).backward()
    xr = [a.clone().requires_grad_() for a in (x, w, b)]
    z = F.linear(*xr)
    (F.cross_entropy(z, t, label_smoothing=0.1, reduction="sum") if used == "loss" else z.pow(2).mean()).backward()
    for a, r in zip(xs, xr):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_dw_blocks_cover_the_vocabulary_once():
    from opsmath.kernels.linear_cross_entropy import _dw_blocks
    for V, C in [(1, 8), (4095, 768), (50304, 768), (128256, 4096), (0, 16)]:
        blocks = _dw_blocks(V, C)
        assert blocks[0][0] == 0 and blocks[-1][1] == V
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert all(v1 - v0 >= min(V, 4096) for v0, v1 in blocks[:-1])


@pytest.mark.skipif(DEVICE != "cuda", reason="cuBLAS bf16 -> fp32 addmm")
def test_fp32_accumulation_in_place_is_available_and_right():
    """The fast path: dW's fp32 accumulator is its own GEMM output (no second V x C fp32 buffer)."""
    from opsmath.kernels.linear_cross_entropy import _accumulate, _inplace_fp32_addmm_ok
    assert _inplace_fp32_addmm_ok(torch.device("cuda"))
    acc = torch.randn(300, 70, device="cuda")
    a, b = torch.randn(300, 129, device="cuda").bfloat16(), torch.randn(129, 70, device="cuda").bfloat16()
    want = acc + a.double().matmul(b.double()).float()
    ptr = acc.data_ptr()
    _accumulate(acc, a, b)
    assert acc.data_ptr() == ptr
    torch.testing.assert_close(acc, want, rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(DEVICE != "cuda", reason="measures CUDA allocations")
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_declared_workspace_covers_what_the_op_allocates(wdtype):
    """The op spec's ``workspace`` (what the recompute planner holds at the end of the forward) against
    the CUDA peak the op reaches above its inputs and outputs: within 10%, never below by more."""
    from opsmath.kernels.linear_cross_entropy import SPEC
    torch.manual_seed(0)
    N, C, V = 8192, 768, 50304
    x = torch.randn(N, C, device="cuda", dtype=wdtype)        # the op computes in its operands' dtype
    w = (torch.randn(V, C, device="cuda") / C ** 0.5).to(wdtype)
    t = torch.randint(0, V, (N,), device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs = linear_cross_entropy_forward(x, w, None, t, -100, 0.0, "mean", True)
    torch.cuda.synchronize()
    kept = sum(o.numel() * o.element_size() for o in outs)
    used = torch.cuda.max_memory_allocated() - before - kept
    declared = SPEC.workspace(x, w, None, t, -100, 0.0, "mean", True)
    assert 0.9 * declared <= used <= 1.1 * declared, (used, declared)
