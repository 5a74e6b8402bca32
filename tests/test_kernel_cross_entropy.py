"""opsmath::cross_entropy vs ``F.cross_entropy(logits.float(), t)``: docs/design.md's rule against float64,
loss and dlogits, odd vocabularies, ignore_index, label smoothing, mean and sum; the Triton row kernel
through the interpreter on CPU."""
import pytest
import torch
import torch.nn.functional as F

from opsmath.kernels.cross_entropy import cross_entropy, cross_entropy_op
from tolerance import assert_rule

from conftest import DEVICE

CASES = [  # N, V, ignore, smoothing, reduction, non-contiguous
    (37, 101, False, 0.0, "mean", False),
    (64, 5000, True, 0.1, "sum", False),
    (33, 257, True, 0.0, "mean", True),
]
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def make(case, dtype):
    N, V, ignore, _, _, strided = case
    torch.manual_seed(0)
    z = 3 * torch.randn(N, V * (2 if strided else 1), device=DEVICE, dtype=dtype)
    z = z[:, ::2] if strided else z
    t = torch.randint(0, V, (N,), device=DEVICE)
    if ignore:
        t[::4] = -100
    return z, t


def run(fn, z, dtype):
    x = z.detach().to(dtype).requires_grad_()
    loss = fn(x)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["reference", "triton"])
def test_matches_eager(case, dtype, path, request):
    if path == "triton":
        request.getfixturevalue("triton_on_cpu")
    elif DEVICE == "cuda":
        pytest.skip("CUDA tensors always take the Triton path")
    _, _, _, smoothing, reduction, _ = case
    z, t = make(case, dtype)

    def eager(x):
        return F.cross_entropy(x.float(), t, label_smoothing=smoothing, reduction=reduction)
    fused = run(lambda x: cross_entropy(x, t, -100, smoothing, reduction), z, dtype)
    same = run(eager, z, dtype)
    ref = run(lambda x: F.cross_entropy(x, t, label_smoothing=smoothing, reduction=reduction), z, torch.float64)
    for name, f, e, r in zip(["loss", "dlogits"], fused, same, ref):
        assert_rule(f, e, r, name=name)
    assert fused[1].dtype == dtype


def test_input_untouched_eval_mode_and_errors():
    z, t = make(CASES[0], torch.float32)
    before = z.clone()
    loss, lse = cross_entropy_op(z, t, -100, 0.0, "mean")
    assert torch.equal(z, before) and lse.shape == z.shape[:1]
    torch.testing.assert_close(lse, torch.logsumexp(z, 1))
    with torch.no_grad():
        loss2 = cross_entropy(z, t)
    torch.testing.assert_close(loss2, F.cross_entropy(z, t))
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy_op(z, t, -100, 0.0, "none")
    with pytest.raises(ValueError, match=r"\(N, V\)"):
        cross_entropy_op(z[None], t, -100, 0.0, "mean")


def test_opcheck():
    z, t = make(CASES[0], torch.float32)
    torch.library.opcheck(cross_entropy_op, (z.requires_grad_(), t, -100, 0.0, "mean"))


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_incoming_gradient_scales_and_graph_reuse(path, request):
    """The incoming gradient (here 3, and -0.5 through a second use with retain_graph) scales dlogits;
    backward recomputes from the saved logits and lse, so the graph can be walked twice."""
    if path == "triton":
        request.getfixturevalue("triton_on_cpu")
    elif DEVICE == "cuda":
        pytest.skip("CUDA tensors always take the Triton path")
    z, t = make(CASES[1], torch.float32)
    x, xr = z.clone().requires_grad_(), z.clone().double().requires_grad_()
    loss = cross_entropy(x, t, -100, 0.1, "sum")
    (3.0 * loss).backward(retain_graph=True)
    (-0.5 * loss).backward()
    (2.5 * F.cross_entropy(xr, t, label_smoothing=0.1, reduction="sum")).backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_masked_vocabulary_with_a_whole_block_of_minus_inf(path, request):
    """Logits of -inf (a vocabulary mask), a whole 4096-wide block of them: the online max/sum must not
    turn them into NaN; loss and gradient equal eager's."""
    if path == "triton":
        request.getfixturevalue("triton_on_cpu")
    elif DEVICE == "cuda":
        pytest.skip("CUDA tensors always take the Triton path")
    torch.manual_seed(0)
    z = 3 * torch.randn(6, 5000, device=DEVICE)
    z[:, :4096] = float("-inf")
    z[:, 4500:4600] = float("-inf")
    t = torch.randint(4096, 4500, (6,), device=DEVICE)
    fused = run(lambda x: cross_entropy(x, t, -100, 0.0, "mean"), z, torch.float32)
    ref = run(lambda x: F.cross_entropy(x, t), z, torch.float64)
    same = run(lambda x: F.cross_entropy(x, t), z, torch.float32)
    assert torch.isfinite(fused[0]) and torch.isfinite(fused[1]).all()
    for name, f, e, r in zip(["loss", "dlogits"], fused, same, ref):
        assert_rule(f, e, r, name=name)


def test_target_out_of_range_is_nan_not_a_wrong_loss(triton_on_cpu):
    """A target outside [0, V) that is not ignore_index: eager raises; the Triton kernel cannot without a
    host sync, so that row's loss and gradient are NaN (the loss is NaN), never a plausible number."""
    z, t = make(CASES[0], torch.float32)
    t = t.clone()
    t[3] = z.shape[1]          # one past the vocabulary
    t[5] = -7                  # negative, not ignore_index
    x = z.clone().requires_grad_()
    loss = cross_entropy(x, t, -100, 0.0, "sum")
    loss.backward()
    assert torch.isnan(loss)
    rows_nan = torch.isnan(x.grad).all(1)
    assert rows_nan[3] and rows_nan[5] and rows_nan.sum() == 2
