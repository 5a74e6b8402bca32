"""The dropout_add_norm rewrite on LayerNorm / RMSNorm spellings, pre- and post-LN."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opsmath
from tolerance import optimized_matches_eager, rel_err

C = 48


class LlamaRMSNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        var = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        return self.weight * x.to(dtype)


class T5LayerNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.eps = eps

    def forward(self, h):
        var = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(var + self.eps))


class NoWeightRMS(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + 1e-5)


class UpcastRMSNorm(nn.Module):
    """``F.rms_norm`` of the residual sum's fp32 upcast, cast back (a library's mixed-precision spelling)."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)


class NormalizeRMSNorm(nn.Module):
    """x-transformers' RMSNorm: ``F.normalize(x, dim=-1) * sqrt(D) * (g + offset)``."""

    def __init__(self, n):
        super().__init__()
        self.g, self.scale = nn.Parameter(torch.rand(n) + 0.5), n ** 0.5

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * (self.g + 0.0)


NORMS = {
    "normalize_rmsnorm": (lambda: NormalizeRMSNorm(C), "rms"),
    "upcast_rms_norm": (lambda: UpcastRMSNorm(C), "rms"),
    "layernorm": (lambda: nn.LayerNorm(C), "layer"),
    "layernorm_no_affine": (lambda: nn.LayerNorm(C, elementwise_affine=False), "layer"),
    "llama_rmsnorm": (lambda: LlamaRMSNorm(C), "rms"),
    "t5_layernorm": (lambda: T5LayerNorm(C), "rms"),
    "rms_no_weight": (NoWeightRMS, "rms"),
    "nn_rmsnorm": (lambda: nn.RMSNorm(C, eps=1e-6), "rms"),
}


class PostLN(nn.Module):
    """BERT order: norm(dropout(f(x)) + x)."""

    def __init__(self, make_norm):
        super().__init__()
        self.f = nn.Linear(C, C)
        self.drop = nn.Dropout(0.0)
        self.norm = make_norm()

    def forward(self, x):
        return self.norm(self.drop(self.f(x)) + x)


class PreLN(nn.Module):
    """GPT/LLaMA order: h = x + f(x); out = h + g(norm(h)) — the residual sum is also an output."""

    def __init__(self, make_norm):
        super().__init__()
        self.f = nn.Linear(C, C)
        self.g = nn.Linear(C, C)
        self.norm = make_norm()

    def forward(self, x):
        h = x + F.dropout(self.f(x), 0.0, self.training)
        return h + self.g(self.norm(h))


def _check(model, x):
    return optimized_matches_eager(model, x)


@pytest.mark.parametrize("order", [PostLN, PreLN], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("norm", list(NORMS))
def test_norm_spelling_is_rewritten_and_exact(norm, order):
    torch.manual_seed(0)
    make, kind = NORMS[norm]
    rep = _check(order(make), torch.randn(2, 5, C))
    assert rep.count("dropout_add_norm") == 1, rep.render(width=120)
    d = rep.matches[0].details
    assert d["norm"] == kind
    assert d["residual_out"] == (order is PreLN)


def test_broadcast_add_is_not_a_residual():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.randn(1, 5, C))
            self.norm = nn.LayerNorm(C)

        def forward(self, x):
            return self.norm(x + self.pos[:, :, :].expand(1, 5, C) * 1.0)

    torch.manual_seed(0)
    rep = _check(M(), torch.randn(2, 5, C))
    assert rep.count("dropout_add_norm") == 0


def test_dropout_is_fused_in_training_and_exact_in_eval():
    torch.manual_seed(0)
    model = PostLN(lambda: nn.LayerNorm(C))
    model.drop.p = 0.25
    eager = copy.deepcopy(model).eval()
    opt = opsmath.optimize(model)
    x = torch.randn(4, 7, C)
    opt(x).sum().backward()
    rep = opsmath.report(opt)
    assert rep.matches[0].details["dropout_p"] == 0.25
    opt.eval()
    with torch.no_grad():
        assert rel_err(opt(x), eager(x)) < 1e-6
    assert len(opsmath.report(opt).graphs) == 2  # train and eval variants


def test_norm_of_a_narrowed_residual_sum_is_declined_with_the_reason():
    """``F.rms_norm(h.bfloat16(), ...)`` of an fp32 sum: the fused op would read h unrounded."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.f, self.w = nn.Linear(C, C), nn.Parameter(torch.ones(C, dtype=torch.bfloat16))

        def forward(self, x):
            h = x + self.f(x)
            return F.rms_norm(h.bfloat16(), (C,), self.w, 1e-6).float() + h

    torch.manual_seed(0)
    rep = _check(M(), torch.randn(2, 5, C))
    assert rep.count("dropout_add_norm") == 0
    assert any("rounded to torch.bfloat16 before the norm" in d.reason for d in rep.declines), rep.declines


def test_normalize_scaled_otherwise_is_declined_with_the_reason():
    """``F.normalize(h) * g`` without sqrt(D) is not an RMS norm: declined, named."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.f, self.g = nn.Linear(C, C), nn.Parameter(torch.rand(C) + 0.5)

        def forward(self, x):
            return F.normalize(x + self.f(x), dim=-1) * 2.0 * self.g

    torch.manual_seed(0)
    rep = _check(M(), torch.randn(2, 5, C))
    assert rep.count("dropout_add_norm") == 0
    assert any("not sqrt(48)" in d.reason for d in rep.declines), rep.declines


@pytest.mark.parametrize("width", [48, 37])
def test_normalize_rmsnorm_on_zero_and_odd_rows_matches_eager(width):
    """An all-zero residual row (F.normalize gives 0) and an odd width: forward and gradients as eager."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.f, self.norm = nn.Linear(width, width), NormalizeRMSNorm(width)

        def forward(self, x, r):
            return self.norm(r + self.f(x))

    torch.manual_seed(0)
    model = M()
    x, r = torch.randn(3, 7, width), torch.randn(3, 7, width)
    with torch.no_grad():   # row (0, 0): the residual cancels the branch exactly
        r[0, 0] = -model.f(x[0, 0])
    rep = optimized_matches_eager(model, x, r)
    assert rep.count("dropout_add_norm") == 1
