"""FP8 linear layers (``optimize(model, fp8=True)``): the FP8 GEMMs forward and backward against the
same quantization in fp32 matmuls and against bf16, the per-layer decision with its reason, opt-in.

FP8 is outside the tolerance rule: bounds here are the quantization's own error (e4m3 keeps 3 mantissa
bits, e5m2 2), measured on CPU against the dequantized product and, for the GEMMs themselves, on the GPU
when there is one (``torch._scaled_mm``)."""
import copy

import pytest
import torch
import torch.nn as nn

import opsmath
from opsmath.kernels.fp8_linear import E4M3, fp8_linear, quantize, reference, underflow
from conftest import DEVICE
from tolerance import rel_err

pytestmark = pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without FP8 dtypes")


def test_fp8_linear_matches_its_quantized_reference_and_bf16():
    torch.manual_seed(0)
    x = torch.randn(3, 37, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    w = (torch.randn(48, 64, device=DEVICE) / 8).to(torch.bfloat16).requires_grad_()
    b = torch.randn(48, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    y = fp8_linear(x, w, b)
    assert rel_err(y.float(), reference(x, w, b).float()) < 1e-2            # the same quantization
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert 1e-3 < rel_err(y.float(), ref) < 6e-2                              # FP8's own error
    dy = torch.randn_like(y)
    y.backward(dy)
    gx, gw, gb = torch.autograd.grad(ref, (x, w, b), dy.float())
    assert rel_err(x.grad.float(), gx) < 0.1 and rel_err(w.grad.float(), gw) < 0.1
    assert rel_err(b.grad.float(), gb) < 1e-2                                  # bias grad: no FP8


def test_rowwise_fp8_linear_matches_its_reference_and_every_gradient():
    """Rowwise: forward against the same quantization in fp32, and each gradient against the GEMM it
    approximates, computed from the operands quantized as documented (dy per row and x, W per column)."""
    torch.manual_seed(0)
    x = torch.randn(2, 35, 64, dtype=torch.bfloat16, device=DEVICE)
    x[0, 3] *= 100                                                   # an outlier row: its own scale
    x.requires_grad_()
    w = (torch.randn(48, 64, device=DEVICE) / 8).to(torch.bfloat16).requires_grad_()
    b = torch.randn(48, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    y = fp8_linear(x, w, b, rowwise=True)
    assert rel_err(y.float(), reference(x, w, b, rowwise=True).float()) < 1e-2
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    rest = torch.ones(2, 35, dtype=torch.bool, device=DEVICE)
    rest[0, 3] = False   # the other rows, whose tensorwise scale the outlier sets: rowwise no worse there
    # (e4m3's own 3 mantissa bits dominate the error of both)
    assert rel_err(y.float()[rest], ref[rest]) < 1.1 * rel_err(fp8_linear(x, w, b).float()[rest], ref[rest])
    dy = torch.randn_like(y)
    y.backward(dy)
    g = dy.reshape(-1, 48)
    gq_r, sg_r = quantize(g, E4M3, -1)
    wq_c, sw_c = quantize(w, E4M3, 0)
    gq_c, sg_c = quantize(g, E4M3, 0)
    xq_c, sx_c = quantize(x.detach().reshape(-1, 64), E4M3, 0)
    dx = (gq_r.float() * sg_r) @ (wq_c.float() * sw_c)
    dw = (gq_c.float() * sg_c).t() @ (xq_c.float() * sx_c)
    assert rel_err(x.grad.reshape(-1, 64).float(), dx) < 1e-2 and rel_err(w.grad.float(), dw) < 1e-2
    gx, gw, gb = torch.autograd.grad(ref, (x, w, b), dy.float())
    assert rel_err(x.grad.float(), gx) < 0.1 and rel_err(w.grad.float(), gw) < 0.1
    assert rel_err(b.grad.float(), gb) < 1e-2


def test_optimize_fp8_rowwise_emits_rowwise_linears(monkeypatch):
    monkeypatch.setattr("opsmath.patterns.fp8_linear.MIN_DIM", 32)
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    opt = opsmath.optimize(copy.deepcopy(model), fp8="rowwise")
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    assert rel_err(opt(x).float(), model(x).float()) < 5e-2
    rep = opsmath.report(opt)
    fp8 = [m for m in rep.matches if m.pattern == "fp8_linear"]
    assert fp8 and all("rowwise" in m.replacement for m in fp8), [m.replacement for m in fp8]


def test_quantize_scales_amax_to_the_format_max_and_keeps_zeros():
    t = torch.tensor([0.0, 1.0, -3.0, 2e-7])
    q, s = quantize(t, E4M3)
    assert s.item() == pytest.approx(3.0 / 448) and q.float().abs().max().item() == 448
    assert q.float()[0] == 0 and underflow(t) == pytest.approx(1 / 3)       # 2e-7 flushes
    zq, zs = quantize(torch.zeros(4), E4M3)
    assert zs.item() == 1.0 and zq.float().abs().sum() == 0


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.odd, self.down = nn.Linear(64, 128), nn.Linear(128, 24), nn.Linear(24 + 128 - 24, 64)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(h) + self.odd(h).sum(-1, keepdim=True)


def test_optimize_fp8_rewrites_large_enough_linears_and_says_why_not_others(monkeypatch):
    monkeypatch.setattr("opsmath.patterns.fp8_linear.MIN_DIM", 32)
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    eager, opt = copy.deepcopy(model), opsmath.optimize(copy.deepcopy(model), fp8=True)
    le, lo = eager(x).float().pow(2).mean(), opt(x).float().pow(2).mean()
    le.backward()
    lo.backward()
    assert rel_err(lo.detach(), le.detach()) < 5e-2
    # FP8's own error: e5m2 gradients (2 mantissa bits) summed over only 64 tokens; the first layer's weight
    # gradient measured 0.148 (torch 2.13, CPU) and 0.172 (torch 2.11) against bf16 eager, and the same
    # against fp64 (the exactness of the GEMMs themselves: test_fp8_linear_matches_its_quantized_reference)
    for p, q in zip(eager.parameters(), opt.parameters()):
        assert rel_err(q.grad.float(), p.grad.float()) < 0.25
    rep = opsmath.report(opt)
    assert sorted(m.details["K"] for m in rep.matches if m.pattern == "fp8_linear") == [64, 128]
    (why,) = [d.reason for d in rep.declines if d.pattern == "fp8_linear"]
    assert "multiples of 16" in why


@pytest.mark.parametrize("inductor", [False, True])
def test_fp8_runs_fp32_master_weights_under_bf16_autocast(monkeypatch, inductor):
    """The usual mixed precision (fp32 parameters, bf16 autocast): the linears run FP8 from explicit bf16
    casts, and each fp32 parameter gets its gradient through them, close to eager autocast's."""
    if inductor and __import__("shutil").which("g++") is None:
        pytest.skip("Inductor on CPU needs a C++ compiler")
    monkeypatch.setattr("opsmath.patterns.fp8_linear.MIN_DIM", 32)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(4, 16, 64)
    eager, opt = copy.deepcopy(model), opsmath.optimize(copy.deepcopy(model), fp8=True, inductor=inductor)
    with torch.autocast("cpu", torch.bfloat16):
        le, lo = eager(x).float().pow(2).mean(), opt(x).float().pow(2).mean()
    le.backward()
    lo.backward()
    assert rel_err(lo.detach(), le.detach()) < 5e-2
    for p, q in zip(eager.parameters(), opt.parameters()):
        assert q.grad.dtype == torch.float32 and rel_err(q.grad, p.grad) < 0.2   # e5m2 gradients: ~0.15
    rep = opsmath.report(opt)
    assert sorted(m.details["K"] for m in rep.matches if m.pattern == "fp8_linear") == [64, 128]
    plain = opsmath.optimize(copy.deepcopy(model), fp8=True)          # fp32 without autocast: stays
    plain(x).sum().backward()
    assert not [m for m in opsmath.report(plain).matches if m.pattern == "fp8_linear"]
    assert any("computing in torch.float32" in d.reason for d in opsmath.report(plain).declines)


def test_fp8_is_opt_in_and_small_gemms_stay_bf16():
    model = MLP().to(torch.bfloat16)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    plain = opsmath.optimize(copy.deepcopy(model))
    plain(x).sum().backward()
    assert not [m for m in opsmath.report(plain).matches if m.pattern == "fp8_linear"]
    small = opsmath.optimize(copy.deepcopy(model), fp8=True)      # 16 rows, K 64: below MIN_DIM
    small(x).sum().backward()
    rep = opsmath.report(small)
    assert not [m for m in rep.matches if m.pattern == "fp8_linear"]
    assert any("stays bf16" in d.reason for d in rep.declines if d.pattern == "fp8_linear")
    with pytest.raises(ValueError, match="rowwise"):
        opsmath.optimize(copy.deepcopy(model), fp8="delayed")


class Projections(nn.Module):
    """q (64 -> 64) with k and v (64 -> 16) on the same input, as attention projects; ``solo`` (64 -> 16)
    on its own input; ``a``/``b`` (64 -> 16) share an input but neither runs FP8 on its own sizes."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 16), nn.Linear(64, 16)
        self.solo, self.a, self.b = nn.Linear(64, 16), nn.Linear(64, 16), nn.Linear(64, 16)

    def forward(self, x):
        h = torch.tanh(x)
        g = torch.sigmoid(x)
        return torch.cat([self.q(x), self.k(x), self.v(x), self.solo(h), self.a(g) * self.b(g)], -1)


def test_layers_sharing_an_fp8_layers_input_run_fp8_from_the_lower_threshold(monkeypatch):
    monkeypatch.setattr("opsmath.patterns.fp8_linear.MIN_DIM", 32)
    monkeypatch.setattr("opsmath.patterns.fp8_linear.SHARED_MIN_DIM", 16)
    torch.manual_seed(0)
    model = Projections().to(torch.bfloat16)
    opt = opsmath.optimize(copy.deepcopy(model), fp8=True)
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    lo, le = opt(x), model(x)
    assert rel_err(lo.detach().float(), le.detach().float()) < 5e-2
    lo.float().pow(2).mean().backward()
    le.float().pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), opt.parameters()):
        assert rel_err(q.grad.float(), p.grad.float()) < 0.15, name
    rep = opsmath.report(opt)
    assert sorted(m.details["weight"] for m in rep.matches if m.pattern == "fp8_linear") == \
        ["k.weight", "q.weight", "v.weight"]
    assert sum("stays bf16" in d.reason for d in rep.declines if d.pattern == "fp8_linear") == 3


def test_report_gives_each_fp8_weights_flushed_share(monkeypatch):
    """The report names each FP8 linear's weight and the share of its nonzero values e4m3 scaling
    flushes to zero: none for a normal init, about half when half the weight is 1e-9 x the rest."""
    monkeypatch.setattr("opsmath.patterns.fp8_linear.MIN_DIM", 32)
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    with torch.no_grad():
        model.up.weight[:64] *= 1e-9
    opt = opsmath.optimize(model, fp8=True)
    opt(torch.randn(4, 16, 64, dtype=torch.bfloat16)).sum().backward()
    rep = opsmath.report(opt)
    got = {r["weight"]: r["underflow"] for r in rep.fp8_underflow()}
    assert set(got) == {"up.weight", "down.weight"}, got
    assert 0.45 < got["up.weight"] <= 0.5 and got["down.weight"] < 0.01, got
    assert "FP8 weights flushed to zero" in rep.render(width=200) and "up.weight" in rep.render(width=200)


def test_report_counts_activation_and_gradient_underflow_without_changing_the_model(monkeypatch):
    """Given a batch, each FP8 linear's input (e4m3) and output gradient (e5m2) shares flushed to zero are
    measured on one eager step: half of ``up``'s input features at 1e-9 x the rest read about 0.5; the
    step touches no ``.grad``, no RNG state, and the model keeps its compiled path."""
    monkeypatch.setattr("opsmath.patterns.fp8_linear.MIN_DIM", 32)
    torch.manual_seed(0)
    opt = opsmath.optimize(MLP().to(torch.bfloat16), fp8=True)
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    x[..., :32] *= 1e-9
    opt(x).sum().backward()
    grads = [p.grad.clone() for p in opt.parameters()]
    torch.manual_seed(5)
    rows = {r["weight"]: r for r in opsmath.report(opt).fp8_underflow((x,), loss_fn=lambda y: y.float().pow(2).mean())}
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, opt.parameters()))
    assert 0.45 < rows["up.weight"]["activation"] <= 0.5, rows
    assert rows["down.weight"]["activation"] < 0.01 and rows["down.weight"]["gradient"] < 0.01, rows
    assert rows["up.weight"]["gradient"] is not None
    assert opt._compiled_call_impl is not None   # later calls still take the optimized path


def test_the_op_is_the_same_inside_a_selective_checkpoint_under_autocast():
    """PyTorch's CPU ``_scaled_mm`` multiplies with an ATen matmul that an enclosing autocast would run in
    bf16, and a selective checkpoint region runs its ops below autocast: the op's forward must not
    depend on which (a memory plan's region gave another loss than the same model without a plan)."""
    from opsmath.memory.plan_emit import selective_checkpoint
    torch.manual_seed(0)
    x = torch.randn(128, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        plain = fp8_linear(x, w)
        region = selective_checkpoint(fp8_linear, x, w, use_reentrant=False)
    assert torch.equal(plain, region)
