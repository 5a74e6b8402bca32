"""opsmath::swiglu and opsmath::bias_gelu against PyTorch: docs/design.md's rule against float64 on the
output and every gradient, odd widths, row-strided inputs (the halves of one ``chunk``), both GELU forms;
the Triton kernels through the interpreter on CPU."""
import pytest
import torch
import torch.nn.functional as F

from opsmath.kernels.bias_gelu import bias_gelu
from opsmath.kernels.swiglu import swiglu
from tolerance import assert_rule

from conftest import DEVICE

DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
SHAPES = [(3, 7, 33), (5, 1100), (64, 2048)]   # odd widths, a width over one block
if DEVICE == "cuda":   # model-sized rows only a GPU runs in reasonable time (LLaMA-1.1B MLP, GPT-2 MLP)
    SHAPES += [(4096, 5632), (2, 1024, 3072)]


def _path(path, request):
    if path == "triton":
        request.getfixturevalue("triton_on_cpu")
    elif DEVICE == "cuda":
        pytest.skip("CUDA tensors always take the Triton path")


def _grads(fn, inputs, dtype, dy):
    xs = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out = fn(*xs)
    out.backward(dy.to(dtype))
    return [out.detach()] + [x.grad for x in xs]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("chunked", [False, True], ids=["separate", "chunk"])
def test_swiglu_matches_eager(shape, dtype, path, chunked, request):
    _path(path, request)
    torch.manual_seed(0)
    H = shape[-1]
    if chunked:   # one projection split in two: row-strided views, read without a copy
        ab = 3 * torch.randn(*shape[:-1], 2 * H, device=DEVICE)
        inputs = [ab]
        split = (lambda f: lambda t: f(*t.chunk(2, dim=-1)))  # noqa: E731
    else:
        inputs = [3 * torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)]
        split = (lambda f: f)  # noqa: E731
    dy = torch.randn(shape, device=DEVICE)
    fused = _grads(split(swiglu), inputs, dtype, dy)
    eager = _grads(split(lambda a, b: F.silu(a) * b), inputs, dtype, dy)
    ref = _grads(split(lambda a, b: F.silu(a) * b), inputs, torch.float64, dy)
    for name, f, e, r in zip(["y", "da", "db"], fused, eager, ref):
        assert_rule(f, e, r, name=name)
    assert fused[0].dtype == dtype


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_matches_eager(shape, dtype, path, approximate, request):
    _path(path, request)
    torch.manual_seed(0)
    x, b = 2 * torch.randn(shape, device=DEVICE), torch.randn(shape[-1], device=DEVICE)
    dy = torch.randn(shape, device=DEVICE)
    fused = _grads(lambda x, b: bias_gelu(x, b, approximate), [x, b], dtype, dy)   # dropout 0
    eager = _grads(lambda x, b: F.gelu(x + b, approximate=approximate), [x, b], dtype, dy)
    ref = _grads(lambda x, b: F.gelu(x + b, approximate=approximate), [x, b], torch.float64, dy)
    for name, f, e, r in zip(["y", "dx", "dbias"], fused, eager, ref):
        assert_rule(f, e, r, name=name)


@pytest.mark.parametrize("shape", [(37, 100), (5, 1100), (70, 3000)], ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_every_tuning_candidate_matches_eager(shape, approximate, triton_on_cpu, monkeypatch):
    """Each launch configuration the tuner may pick (``bias_gelu._configs``: tiles, rows per program,
    warps), forced in turn, forward and backward with dropout, against the reference."""
    from opsmath.kernels import bias_gelu as bg
    torch.manual_seed(0)
    x, b = 2 * torch.randn(shape, device=DEVICE), torch.randn(shape[-1], device=DEVICE)
    dy = torch.randn(shape, device=DEVICE)
    args = (approximate, 0.2, 5)   # dropout 0.2, seed 5
    ref = (bg.bias_gelu_reference(x, b, *args), *bg.bias_gelu_backward_reference(dy, x, b, *args))
    for i in range(3):
        monkeypatch.setattr(bg, "tuned_config", lambda op, key, configs, run, device: list(configs.values())[i])
        got = (bg.bias_gelu_forward_triton(x, b, *args), *bg.bias_gelu_backward_triton(dy, x, b, *args))
        for name, g, r in zip(["y", "dx", "dbias"], got, ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} config {i}: {m}")


def test_bias_gelu_fp32_bias_on_low_precision_input(triton_on_cpu):
    """Under autocast the GEMM's output is bf16 and the bias an fp32 parameter: y in bf16, dbias fp32; y is
    within one bf16 spacing of gelu(x + b) (relative 2^-7), not always its nearest bf16 value (seed 0: 4.3125
    for 4.3417, where 4.34375 is nearer)."""
    torch.manual_seed(0)
    x = torch.randn(9, 40, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(40, device=DEVICE, requires_grad=True)
    y = bias_gelu(x, b)
    y.sum().backward()
    assert y.dtype == torch.bfloat16 and b.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    ref = F.gelu(x.detach().double() + b.detach().double())
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-4).all(), (y.double() - ref).abs().max()


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="one shape"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(ValueError, match="bias of shape"):
        bias_gelu(torch.randn(2, 3), torch.randn(4))
    with pytest.raises(ValueError, match="approximate"):
        bias_gelu(torch.randn(2, 3), torch.randn(3), "sigmoid")
    with pytest.raises(ValueError, match="dropout_p"):
        bias_gelu(torch.randn(2, 3), torch.randn(3), "none", 1.0)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_bias_gelu_dropout_mask_regenerated_and_fraction_dropped(path, request):
    """The Triton mask equals the reference hash bit for bit, backward applies the same mask as forward
    (no mask stored), and the fraction dropped is within 0.01 of p."""
    from opsmath.kernels._common import dropout_keep, flat_offsets
    _path(path, request)
    torch.manual_seed(0)
    p, seed = 0.1, torch.tensor(1234)
    x = torch.randn(96, 257, device=DEVICE, requires_grad=True)
    b = torch.randn(257, device=DEVICE, requires_grad=True)
    dy = torch.randn(96, 257, device=DEVICE)
    out = bias_gelu(x, b, "tanh", p, seed)
    out.backward(dy)
    keep = dropout_keep(1234, flat_offsets(x.shape, x.device), p)
    xr, br = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = F.gelu(xr + br, approximate="tanh") * keep / (1 - p)
    ref.backward(dy.double())
    xe, be = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    eager = F.gelu(xe + be, approximate="tanh") * keep / (1 - p)   # the same mask, PyTorch's fp32 ops
    eager.backward(dy)
    assert_rule(out, eager, ref, name="y")
    assert_rule(x.grad, xe.grad, xr.grad, name="dx")
    assert_rule(b.grad, be.grad, br.grad, name="dbias")
    assert abs((~keep).double().mean().item() - p) < 0.01
    assert (x.grad[~keep] == 0).all() and (out[~keep] == 0).all()   # dropped in both passes


SOFTMAX_CASES = {   # x shape, bias shape or None, scale, bias needs grad
    "router": ((37, 8), None, 1 / 0.7, False),
    "padding": ((2, 3, 5, 33), (2, 1, 1, 33), 0.125, False),
    "causal": ((2, 3, 9, 9), (1, 1, 9, 9), 0.25, False),
    "learned_bias": ((2, 3, 7, 12), (1, 3, 7, 12), 0.5, True),
    "wide_rows": ((3, 5000), (5000,), 1.0, True),
    "wider_than_a_block": ((3, 9000), (9000,), 1.0, True),   # chunked online max/sum (rows > 8192)
}
if DEVICE == "cuda":   # returned attention probabilities of a GPT-2-sized layer, padded
    SOFTMAX_CASES["gpt2_probs"] = ((4, 12, 1024, 1024), (4, 1, 1, 1024), 0.125, False)


@pytest.mark.parametrize("case", list(SOFTMAX_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["reference", "triton"])
def test_scaled_softmax_matches_eager(case, dtype, path, request):
    from opsmath.kernels.softmax import scaled_softmax
    _path(path, request)
    torch.manual_seed(0)
    xs, bs, scale, bias_grad = SOFTMAX_CASES[case]
    x = 3 * torch.randn(xs, device=DEVICE)
    bias = None
    if bs is not None:
        bias = torch.randn(bs, device=DEVICE)
        if case in ("padding", "causal"):   # masks: -inf where not attended, never a whole row
            keep = torch.rand(bs, device=DEVICE) > 0.3 if case == "padding" else \
                torch.ones(bs[-2:], dtype=torch.bool, device=DEVICE).tril().expand(bs)
            keep[..., 0] = True
            bias = torch.where(keep, bias, float("-inf"))
    dy = torch.randn(xs, device=DEVICE)

    def run(fn, dt):
        xx = x.detach().clone().to(dt).requires_grad_()
        bb = None if bias is None else bias.detach().clone().to(dt).requires_grad_(bias_grad)
        out = fn(xx, bb)
        out.backward(dy.to(dt))
        return [out.detach(), xx.grad] + ([bb.grad] if bias_grad else [])
    eager = (lambda xx, bb: torch.softmax(xx * scale + (0 if bb is None else bb), -1))  # noqa: E731
    fused = run(lambda xx, bb: scaled_softmax(xx, bb, scale), dtype)
    same, ref = run(eager, dtype), run(eager, torch.float64)
    for name, f, e, r in zip(["y", "dx", "dbias"], fused, same, ref):
        assert_rule(f, e, r, name=name)


def test_scaled_softmax_bad_bias_is_a_clear_error():
    from opsmath.kernels.softmax import scaled_softmax
    with pytest.raises(ValueError, match="broadcast"):
        scaled_softmax(torch.randn(2, 5), torch.randn(3))
    with pytest.raises(ValueError, match="enlarge"):
        scaled_softmax(torch.randn(1, 5), torch.randn(4, 5))
