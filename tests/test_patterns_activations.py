"""The swiglu and bias_gelu rewrites on the spellings models use: found, rewritten, outputs and
gradients equal to eager; declined (eager kept, reason given) where an intermediate must exist."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opsmath


class SwiGLU(nn.Module):           # LLaMA: down(silu(gate(x)) * up(x))
    def __init__(self, d=16, h=24):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class ChunkedSwiGLU(nn.Module):    # one projection split in two, b * silu(a) order
    def __init__(self, d=16, h=24):
        super().__init__()
        self.w, self.down = nn.Linear(d, 2 * h), nn.Linear(h, d)

    def forward(self, x):
        a, b = self.w(x).chunk(2, dim=-1)
        return self.down(b * nn.SiLU()(a))


class SiluKept(SwiGLU):             # silu(a) also returned: must exist
    def forward(self, x):
        s = F.silu(self.gate(x))
        return self.down(s * self.up(x)) + s.sum()


class GeluMLP(nn.Module):          # nanoGPT / timm Mlp (fc1 -> act -> drop -> fc2)
    def __init__(self, d=16, h=40, approximate="none", p=0.0):
        super().__init__()
        self.fc, self.proj, self.drop = nn.Linear(d, h), nn.Linear(h, d), nn.Dropout(p)
        self.approximate = approximate

    def forward(self, x):
        return self.proj(self.drop(F.gelu(self.fc(x), approximate=self.approximate)))


class GeluAddBias(nn.Module):      # bias added by hand: gelu(x @ W.T + b)
    def __init__(self, d=16, h=40):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(h, d) / 4), nn.Parameter(torch.randn(h))

    def forward(self, x):
        return F.gelu(x @ self.w.t() + self.b, approximate="tanh").sum(-1)


class Conv1D(nn.Module):           # HF GPT-2's linear: addmm(bias, x2d, weight) on a (in, out) weight
    def __init__(self, nf, nx):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(nx, nf) / 4), nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class GPT2MLP(nn.Module):          # c_fc -> gelu_new written out -> c_proj
    def __init__(self, d=16, h=40):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(h, d), Conv1D(d, h)

    def forward(self, x):
        h = self.c_fc(x)
        a = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.c_proj(a)


class PreactKept(GeluMLP):          # the pre-activation also read: must exist
    def forward(self, x):
        h = self.fc(x)
        return self.proj(F.gelu(h)) + h.mean()


def run(model, pattern, x=None):
    torch.manual_seed(0)
    ref = copy.deepcopy(model)
    opt = opsmath.optimize(model, patterns=[pattern], inductor=False)
    x = torch.randn(2, 7, 16) if x is None else x
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    out, ref_out = opt(xs[0]), ref(xs[1])
    out.sum().backward()
    ref_out.sum().backward()
    return opsmath.report(opt).graphs[0], (out, ref_out), (xs, model, ref)


@pytest.mark.parametrize("cls", [SwiGLU, ChunkedSwiGLU])
def test_swiglu_fires_and_matches(cls):
    torch._dynamo.reset()
    g, (out, ref_out), (xs, model, ref) = run(cls(), "swiglu")
    assert g.after_ops["opsmath.swiglu"] == 1 and not g.after_ops.get("aten.silu"), g.after_code
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls,approximate", [(GeluMLP, "none"), (GeluMLP, "tanh"), (GeluAddBias, "tanh"),
                                              (GPT2MLP, "tanh")])
def test_bias_gelu_fires_and_matches(cls, approximate):
    torch._dynamo.reset()
    model = cls(approximate=approximate) if cls is GeluMLP else cls()
    g, (out, ref_out), (xs, model, ref) = run(model, "bias_gelu")
    m = next(m for m in g.matches if m.pattern == "bias_gelu")
    assert m.details["approximate"] == approximate and not g.after_ops.get("aten.gelu"), g.after_code
    assert m.details["spelled_out"] == (cls is GPT2MLP) and not g.after_ops.get("aten.tanh"), g.after_code
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)


class GeluDrop(GeluMLP):
    def forward(self, x):
        return self.drop(F.gelu(self.fc(x)))


def test_bias_gelu_takes_the_dropout_after_it():
    """timm's Mlp: the dropout joins the op (no mask stored). Kept elements are eager's activation over
    (1 - p), the fraction dropped is p, a torch seed makes it repeatable, and eval mode equals eager."""
    torch._dynamo.reset()
    model = GeluDrop(h=512, p=0.25)
    ref = copy.deepcopy(model)
    opt = opsmath.optimize(model, patterns=["bias_gelu"], inductor=False)
    x = torch.randn(8, 9, 16)
    torch.manual_seed(3)
    a = opt(x)
    torch.manual_seed(3)
    b = opt(x)
    g = opsmath.report(opt).graphs[0]
    m = next(m for m in g.matches if m.pattern == "bias_gelu")
    assert m.details["dropout_p"] == 0.25 and not g.after_ops.get("aten.dropout")
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    h = F.gelu(ref.fc(x)).detach()
    kept = a != 0
    torch.testing.assert_close(a[kept], h[kept] / 0.75, rtol=1e-5, atol=1e-6)
    assert abs(1 - kept.double().mean().item() - 0.25) < 0.01
    opt.eval()
    ref.eval()
    torch.testing.assert_close(opt(x), ref(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls,pattern,reason", [(SiluKept, "swiglu", "silu(a) is also read"),
                                                (PreactKept, "bias_gelu", "pre-activation is also read")])
def test_declines_keep_eager_and_say_why(cls, pattern, reason):
    torch._dynamo.reset()
    g, (out, ref_out), _ = run(cls(), pattern)
    assert not [m for m in g.matches if m.pattern == pattern]
    assert any(reason in d.reason for d in g.declines if d.pattern == pattern), g.declines
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)


class Router(nn.Module):           # MoE gate: softmax(logits / T)
    def __init__(self, d=16, experts=8, temperature=0.7):
        super().__init__()
        self.gate, self.t = nn.Linear(d, experts), temperature

    def forward(self, x):
        return torch.softmax(self.gate(x) / self.t, dim=-1) @ torch.arange(8.0)


class ReturnedProbs(nn.Module):    # attention whose probabilities are also returned: attention declines
    def __init__(self, d=16, heads=2, masked=False):
        super().__init__()
        self.qkv, self.h, self.masked = nn.Linear(d, 3 * d), heads, masked
        self.bias = nn.Parameter(torch.randn(1, heads, 1, 7) / 2)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in self.qkv(x).split(C, -1))
        s = q @ k.transpose(-1, -2) * (C // self.h) ** -0.5
        if self.masked:
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        else:
            s = s + self.bias
        p = torch.softmax(s, -1)
        return (p @ v).sum() + (p * p).sum()


@pytest.mark.parametrize("cls,kw,how", [(Router, {}, None), (ReturnedProbs, {}, "bias"),
                                        (ReturnedProbs, {"masked": True}, "mask")])
def test_scaled_softmax_fires_and_matches(cls, kw, how):
    torch._dynamo.reset()
    model = cls(**kw)
    g, (out, ref_out), (xs, model, ref) = run(model, "scaled_softmax", torch.randn(2, 7, 16))
    m = next(m for m in g.matches if m.pattern == "scaled_softmax")
    assert m.details["bias"] == how and not g.after_ops.get("aten.softmax"), g.after_code
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)


def test_attention_softmax_is_left_to_attention():
    """With every family on, a plain attention is the attention pattern's; scaled_softmax takes nothing."""
    torch._dynamo.reset()

    class Attn(ReturnedProbs):
        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in self.qkv(x).split(C, -1))
            return (torch.softmax(q @ k.transpose(-1, -2) * 0.25 + self.bias, -1) @ v).sum()
    opt = opsmath.optimize(Attn(), inductor=False)
    opt(torch.randn(2, 7, 16)).backward()
    rep = opsmath.report(opt)
    assert rep.count("attention") == 1 and rep.count("scaled_softmax") == 0


def test_softmax_with_a_dtype_argument_is_left_alone():
    """``softmax(x * c, -1, dtype=float64)`` converts; the fused op would keep x's dtype: no rewrite."""
    torch._dynamo.reset()

    class M(nn.Module):
        def forward(self, x):
            return torch.softmax(x * 0.5, dim=-1, dtype=torch.float64)
    opt = opsmath.optimize(M(), inductor=False)
    x = torch.randn(3, 5)
    y = opt(x)
    assert y.dtype == torch.float64 and opsmath.report(opt).count("scaled_softmax") == 0
    torch.testing.assert_close(y, torch.softmax(x * 0.5, -1, dtype=torch.float64))


def test_softmax_masked_with_a_finite_fill_is_left_alone():
    """``masked_fill(s, mask, -1e4)`` sets scores (a fully masked row turns uniform); an additive bias
    would not, so that spelling is not rewritten and a fully masked row stays uniform."""
    torch._dynamo.reset()

    class M(nn.Module):
        def forward(self, x, mask):
            return torch.softmax((x * 0.5).masked_fill(mask, -1e4), -1)
    opt = opsmath.optimize(M(), inductor=False)
    x, mask = torch.randn(3, 6), torch.zeros(3, 6, dtype=torch.bool)
    mask[1] = True
    y = opt(x, mask)
    assert opsmath.report(opt).count("scaled_softmax") == 0
    torch.testing.assert_close(y[1], torch.full((6,), 1 / 6))
