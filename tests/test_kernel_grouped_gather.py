"""The grouped GEMM that reads its rows through an index (``src/opsmath/kernels/grouped_gather.py``) against
``x[rows]`` and a per-group fp32 loop: forward, both gradients (a token in several rows sums them), empty
groups, rows past the last group, odd sizes, both weight layouts; its Triton path (the interpreter on CPU) and
the gather-then-grouped path; and the measured choice's overrides."""
import pytest
import torch

from opsmath.kernels import grouped_mm as gm
from opsmath.kernels.grouped_gather import gather_wins, grouped_mm_gather, reference
from tolerance import assert_rule


def _case(T, S, K, N, sizes, transposed, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g)
    w = torch.randn(len(sizes), N, K, generator=g).transpose(1, 2) if transposed \
        else torch.randn(len(sizes), K, N, generator=g)
    rows = torch.randint(0, T, (S,), generator=g)          # a token may appear in several rows, or none
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    return x, rows, w, offs, torch.randn(S, N, generator=g)


def _grads(fn, x, w, dy):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("triton", [False, True], ids=["gather_then_grouped", "triton"])
@pytest.mark.parametrize("dtype,T,S,K,N,sizes,transposed", [
    (torch.float32, 23, 37, 13, 21, [5, 0, 20, 9], False),     # odd sizes, an empty group, rows past the end
    (torch.float32, 40, 150, 19, 33, [70, 0, 60, 20], True),  # a group over two row tiles, nn.Linear layout
    (torch.float16, 16, 32, 24, 40, [20, 10], False),          # fp16 (autocast fp16)
    (torch.bfloat16, 32, 64, 32, 48, [10, 30, 0, 24], True),   # aligned bf16: torch._grouped_mm off Triton
])
def test_matches_gather_then_per_group_products(dtype, T, S, K, N, sizes, transposed, triton, triton_on_cpu,
                                                 device, monkeypatch):
    if triton and device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 wrongly; the GPU runs this case")
    if triton:   # fp32 too, which the op keeps off Triton on CUDA: checks the kernels' indexing exactly
        monkeypatch.setattr(gm, "TRITON_DTYPES", (torch.float32, torch.float16, torch.bfloat16))
    elif device == "cpu":
        monkeypatch.delenv("OPSMATH_TRITON_ON_CPU", raising=False)
    else:
        pytest.skip("on a GPU 16-bit operands take the Triton path")
    x, rows, w, offs, dy = _case(T, S, K, N, sizes, transposed, seed=len(sizes) + K)

    def run(a, b, dt, dev):
        return _grads(lambda u, v: grouped_mm_gather(u, rows.to(dev), v, offs.to(dev)), a.to(dev, dt),
                      b.to(dev, dt), dy.to(dev, dt))
    y, dx, dw = (t.cpu() for t in run(x, w, dtype, device))
    ye, dxe, dwe = _grads(lambda u, v: reference(u, rows, v, offs).to(u.dtype), x.to(dtype), w.to(dtype), dy.to(dtype))
    yr, dxr, dwr = _grads(lambda u, v: reference(u, rows, v, offs), x.double(), w.double(), dy.double())
    end = sum(sizes)
    for got, eager, ref, name in ((y[:end], ye[:end], yr[:end], "y"), (dx, dxe, dxr, "dx"), (dw, dwe, dwr, "dw")):
        assert_rule(got.float(), eager.float(), ref, atol=1e-2 if dtype != torch.float32 else 1e-5, name=name)
    assert torch.equal(y[end:].float(), torch.zeros(S - end, N)), "rows past the last group are zero"
    assert all(dw[g].abs().max() == 0 for g, s in enumerate(sizes) if s == 0)
    untouched = sorted(set(range(T)) - set(rows[:end].tolist()))
    assert dx[untouched].abs().max() == 0 if untouched else True, "a token in no group's rows gets no gradient"


def test_a_linear_stacks_weight_gradient_arrives_in_its_layout(triton_on_cpu, device, monkeypatch):
    monkeypatch.setattr(gm, "TRITON_DTYPES", (torch.float32, torch.float16, torch.bfloat16))
    w = torch.randn(3, 20, 12, device=device, requires_grad=True)
    arrived = []
    w.register_hook(lambda g: arrived.append(g.stride()))
    rows = torch.tensor([1, 0, 4, 4, 2, 3, 0], device=device)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32, device=device)
    grouped_mm_gather(torch.randn(5, 12, device=device), rows, w.transpose(1, 2), offs).sum().backward()
    assert arrived == [w.stride()]


def test_the_choice_is_opt_in_and_measured_only_on_cuda(monkeypatch):
    """Off by default (GPU or not); ``1`` on; ``auto`` measures on CUDA only (off elsewhere)."""
    cpu = (64, 32, 16, 16, 4, torch.bfloat16, torch.device("cpu"), True)
    monkeypatch.delenv("OPSMATH_GATHER_GEMM", raising=False)
    assert not gather_wins(*cpu) and not gather_wins(*cpu[:6], torch.device("cuda"), True)
    monkeypatch.setenv("OPSMATH_GATHER_GEMM", "1")
    assert gather_wins(*cpu)
    monkeypatch.setenv("OPSMATH_GATHER_GEMM", "auto")
    assert not gather_wins(*cpu)


def test_the_measured_candidates_compute_the_same():
    """What ``gather_wins`` times on a GPU: both spellings, forward and backward, on the same inputs."""
    from opsmath.kernels.grouped_gather import _candidates
    runs = _candidates(64, 32, 16, 8, 4, torch.float32, torch.device("cpu"), True)
    (dx0, dw0), (dx1, dw1) = runs["index+grouped"](), runs["gather"]()
    torch.testing.assert_close(dx1, dx0)
    torch.testing.assert_close(dw1, dw0)



def test_a_compiled_backward_records_the_gathered_weight_gradient(triton_on_cpu, device, monkeypatch):
    """AOTAutograd traces the op's backward on fake tensors, where no kernel can launch (Inductor failed on
    every graph holding the op on the GPU): the weight gradient is an op the backward graph records, and
    the compiled step equals the eager op's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    monkeypatch.setattr(gm, "TRITON_DTYPES", (torch.float32, torch.float16, torch.bfloat16))
    x, rows, w, offs, dy = (t.to(device) for t in _case(21, 30, 12, 10, [9, 0, 14], True, seed=7))
    backward_ops = []

    def keep(g, _):
        return make_boxed_func(g.forward)

    def record(g, _):
        backward_ops.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
        return make_boxed_func(g.forward)

    def f(u, v):
        return grouped_mm_gather(u, rows, v, offs)
    compiled = torch.compile(f, backend=aot_autograd(fw_compiler=keep, bw_compiler=record), fullgraph=True)
    for got, want in zip(_grads(compiled, x, w, dy), _grads(f, x, w, dy)):
        torch.testing.assert_close(got, want)
    assert "opsmath.grouped_mm_gather_weight_grad.default" in backward_ops, backward_ops
