"""Score modifications between QK^T and the softmax: logit softcapping (fused into the kernel, or
left to Inductor where it measured faster), in-place scales, additive masks with fully masked rows, and
the variants still declined with their reason. Models and helpers: ``test_patterns_attention.py``."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opsmath
from attention_harness import C, D, H, T, AttnModel, _compare, _inputs
from tolerance import optimized_matches_eager, rel_err


def softcapped(q, k, v, m):
    """Gemma-2's eager attention: scores * scaling -> / cap -> tanh -> * cap, then the additive mask."""
    att = q @ k.transpose(-2, -1) * D ** -0.5
    att = torch.tanh(att / 50.0) * 50.0
    att = att + torch.zeros(T, T).masked_fill(~m.causal[:T, :T], torch.finfo(torch.float32).min)
    return F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def softcap_that_bites(q, k, v, m):
    """A cap near the scores' size (where tanh saturates), scale on q, padding bias after the cap."""
    att = torch.tanh((q * 3.0) @ k.transpose(-2, -1) * 0.5) * 0.8
    att = att + (1.0 - m.pad[:, None, None, :]) * -1e9
    return F.softmax(att, dim=-1) @ v


@pytest.mark.parametrize("fn,cap,scale,causal", [(softcapped, 50.0, D ** -0.5, True),
                                                 (softcap_that_bites, 0.8, 1.5 * 0.8, False)])
def test_logit_softcapping_is_fused_and_exact(fn, cap, scale, causal):
    """``m * tanh(a * QK^T)`` becomes the kernel's softcap ``c * tanh(scale QK^T / c)`` with c = m,
    scale = a * m; gradients through tanh stay equal to eager's."""
    torch.manual_seed(0)
    rep = _compare(AttnModel(fn), *_inputs())
    assert rep.count("attention") == 1, rep.render(width=120)
    d = rep.matches[0].details
    assert d["softcap"] == pytest.approx(cap) and d["scale"] == pytest.approx(scale) and d["causal"] == causal, d


def tanh_after_bias(q, k, v, m):
    att = torch.tanh(q @ k.transpose(-2, -1) + m.rel_bias[:, :, :T, :T]) * 2.0
    return F.softmax(att, dim=-1) @ v


def baddbmm_rows_from_2d(q, k, v, m):
    """baddbmm whose operands come from 2-D tensors (no 4-D (batch, head) source to read Q/K from)."""
    B = q.shape[0]
    q3, k3 = (t.reshape(B * H * T, D).reshape(B * H, T, D) for t in (q, k))
    s = torch.zeros(1, 1, T).baddbmm(q3, k3.transpose(1, 2), alpha=D ** -0.5).view(B, H, T, T)
    return F.softmax(s, dim=-1) @ v


def clamped_then_flattened(q, k, v, m):
    """XGLM: ``max(QK^T + mask, finfo.min)``, flattened to (B*H) rows for the softmax and the PV bmm."""
    B = q.shape[0]
    s = torch.max(q @ k.transpose(-2, -1) + m.rel_bias[:, :, :T, :T], torch.tensor(torch.finfo(q.dtype).min))
    p = F.softmax(s.view(B * H, T, T), dim=-1)
    return torch.bmm(p, v.reshape(B * H, T, D)).view(B, H, T, D)


def attention_sinks(q, k, v, m):
    """GPT-OSS: a learned logit per head concatenated to the scores, max-subtracted, its column dropped."""
    att = q @ k.transpose(-2, -1) * D ** -0.5
    sinks = m.rel_bias[:, :, :1, :1].reshape(1, H, 1, 1).expand(att.shape[0], -1, att.shape[2], -1)
    logits = torch.cat([att, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return F.softmax(logits, dim=-1)[..., :-1] @ v


def causal_sinks_with_padding(q, k, v, m):
    """GPT-OSS's eager spelling with HF's additive causal + padding mask and the row-max shift."""
    att = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
    att = att + torch.zeros(T, T).masked_fill(~m.causal[:T, :T], torch.finfo(torch.float32).min)
    att = att + (1.0 - m.pad[:, None, None, :]) * torch.finfo(torch.float32).min
    sinks = m.rel_bias[0, :, 0, 0].reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    logits = torch.cat([att, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return F.dropout(F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1], p=0.0) @ v


def windowed_sinks(q, k, v, m):
    """Sinks on a sliding-window causal mask (GPT-OSS's local layers): the window stays a mask."""
    i = torch.arange(T)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4)
    att = (q @ k.transpose(-2, -1)) * D ** -0.5 + torch.zeros(T, T).masked_fill(~keep, float("-inf"))
    sinks = m.rel_bias[0, :, 0, 0].reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    logits = torch.cat([att, sinks], dim=-1)
    return F.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1] @ v


def masked_sinks(q, k, v, m):
    """Sinks after boolean masks (masked_fill): the kernel's mask gets a visible column for the sink."""
    att = (q @ k.transpose(-2, -1)) * D ** -0.5
    att = att.masked_fill(m.pad[:, None, None, :] == 0, float("-inf")).masked_fill(~m.causal[:T, :T], float("-inf"))
    sinks = m.rel_bias[0, :, 0, 0].reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    return F.softmax(torch.cat([att, sinks], dim=-1), dim=-1)[..., :-1] @ v


@pytest.mark.parametrize("fn", [attention_sinks, causal_sinks_with_padding, windowed_sinks, masked_sinks])
def test_attention_sinks_run_as_one_more_key_and_are_exact(fn):
    """GPT-OSS's sinks: the kernel runs them as one more key (and a dummy query row); output and every
    gradient, the sink logits' included, equal to eager."""
    torch.manual_seed(0)
    rep = _compare(AttnModel(fn), *_inputs())
    assert rep.count("attention") == 1, rep.render(width=120)
    assert "sinks" in rep.matches[0].replacement


def cosine_with_logit_scale(q, k, v, m):
    """SwinV2's cosine attention: normalized q, k, a learned per-head logit scale exp(clamp(t)), a bias."""
    att = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    att = att * torch.clamp(m.rel_bias[0, :, :1, :1] * 10, max=4.6).exp() + m.rel_bias[:, :, :T, :T]
    return F.softmax(att, dim=-1) @ v


def temperature_times_scores(q, k, v, m):
    """XCiT's learned temperature on the left, a causal mask after it."""
    att = (m.rel_bias[:, :, :1, :1] + 1.0) * (q @ k.transpose(-2, -1))
    return F.softmax(att.masked_fill(~m.causal[:T, :T], float("-inf")), dim=-1) @ v


def scores_divided_by_a_learned_temperature(q, k, v, m):
    """A learned scalar temperature divided by (CLIP-style), then a causal mask."""
    att = (q @ k.transpose(-2, -1)) / (m.rel_bias[0, 0, 0, 0] + 2.0)
    return F.softmax(att.masked_fill(~m.causal[:T, :T], float("-inf")), dim=-1) @ v


def temperature_over_scores(q, k, v, m):   # ``t / scores`` is no scale of the scores: left alone
    return F.softmax((m.rel_bias[:, :, :1, :1] + 2.0) / (q @ k.transpose(-2, -1)), dim=-1) @ v


@pytest.mark.parametrize("fn,how", [(cosine_with_logit_scale, "scaled"), (temperature_times_scores, "scaled"),
                                    (scores_divided_by_a_learned_temperature, "divided"),
                                    (temperature_over_scores, None)])
def test_scores_scaled_by_a_learned_tensor_are_fused_and_exact(fn, how):
    """A tensor constant over the keys multiplying the scores, or dividing them, scales the queries:
    rewritten, and the scale's own gradient equal to eager's."""
    torch.manual_seed(0)
    rep = _compare(AttnModel(fn), *_inputs())
    assert rep.count("attention") == int(how is not None), rep.render(width=120)
    assert how is None or f"rows {how} by" in rep.matches[0].replacement


def scale_varying_over_keys(q, k, v, m):
    return F.softmax((q @ k.transpose(-2, -1)) * m.rel_bias[:, :, :1, :T].exp(), dim=-1) @ v


def tensor_scale_after_bias(q, k, v, m):
    return F.softmax((q @ k.transpose(-2, -1) + m.rel_bias[:, :, :T, :T]) * m.rel_bias[:, :, :1, :1], dim=-1) @ v


@pytest.mark.parametrize("fn,reason", [(baddbmm_rows_from_2d, "baddbmm"), (tanh_after_bias, "not a logit softcap"),
                                       (scale_varying_over_keys, "varies over the keys"),
                                       (tensor_scale_after_bias, "tensor after a bias"),
                                       (clamped_then_flattened, "clamped from below")])
def test_unfused_score_modifications_are_declined_with_their_name(fn, reason):
    """Variants no kernel takes yet are reported with what was found, and training stays exact."""
    torch.manual_seed(0)
    rep = _compare(AttnModel(fn), *_inputs())
    assert rep.count("attention") == 0
    assert any(d.pattern == "attention" and reason in d.reason for d in rep.declines), rep.declines


class _WideHeadSoftcap(nn.Module):
    """One head of dim 264 (past SOFTCAP_INDUCTOR_HEAD_DIM) with Gemma-2's softcap."""

    def __init__(self, d=264):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.d = d

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(1).split(self.d, dim=-1)
        att = torch.tanh(q @ k.transpose(-2, -1) * self.d ** -0.5 / 20.0) * 20.0
        return (F.softmax(att, dim=-1) @ v).sum()


@pytest.mark.parametrize("inductor", [False, True])
def test_wide_head_softcap_is_left_to_inductor_only_under_inductor(inductor):
    """Where the kernel is not measured faster than Inductor's compiled chain (softcap above head dim 256),
    the rewrite declines under Inductor with that reason; op by op the kernel still takes it."""
    torch.manual_seed(0)
    model = _WideHeadSoftcap()
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model, inductor=inductor)
    x = torch.randn(2, 9, 264)
    y, y_e = opt(x), eager(x)
    assert rel_err(y, y_e) < 1e-5
    rep = opsmath.report(opt)
    assert rep.count("attention") == (0 if inductor else 1), rep.render(width=120)
    if inductor:
        assert any("head dim 264" in d.reason for d in rep.declines), rep.declines


def test_in_place_scale_on_a_view_of_an_input_is_not_folded():
    """``scores.mul_(c)`` folds into the scale only on a fresh intermediate: on a view of something
    else the mutation is visible there, so the op stays and training stays exact."""
    def scaled_through_a_view(q, k, v, m):
        s = q @ k.transpose(-1, -2)
        keep = s.view(-1)      # an alias that sees the in-place scale
        s.mul_(D ** -0.5)
        m.seen = keep.sum()
        return F.softmax(s, dim=-1) @ v + 0 * m.seen

    torch.manual_seed(0)
    rep = _compare(AttnModel(scaled_through_a_view), *_inputs())
    assert rep.count("attention") == 0


def test_additive_mask_with_fully_masked_rows_stays_exact():
    """A row whose every key is masked by ``where(keep, 0, finfo.min)`` is uniform in eager (s + min
    rounds to min) and still passes gradients to Q and K: the rewrite keeps it additive, so both match."""
    def all_masked_for_one_sample(q, k, v, m):
        keep = (m.pad[:, None, None, :] > 0) & (torch.arange(q.shape[0]) != 1)[:, None, None, None]
        s = q @ k.transpose(-1, -2) * D ** -0.5
        return F.softmax(s + torch.where(keep, torch.zeros(()), torch.finfo(torch.float32).min), -1) @ v

    torch.manual_seed(0)
    rep = _compare(AttnModel(all_masked_for_one_sample), *_inputs())
    assert rep.count("attention") == 1, rep.render(width=120)


def test_scale_read_from_a_buffer_is_not_baked_in():
    """A one-element scale from a literal tensor is a constant; one from a buffer may change between
    steps, so it stays an op on K, read at run time: after the buffer changes, still equal to eager."""
    def buffer_scaled(q, k, v, m):
        return F.softmax(q @ (k.transpose(-1, -2) / m.temperature), dim=-1) @ v

    torch.manual_seed(0)
    model = AttnModel(buffer_scaled)
    model.register_buffer("temperature", torch.tensor(2.0))
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    x, pad = _inputs()
    for t in (2.0, 0.5):
        opt.temperature.fill_(t)
        eager.temperature.fill_(t)
        assert rel_err(opt(x, pad), eager(x, pad)) < 1e-5, t
    assert opsmath.report(opt).matches[0].details["scale"] == 1.0


class _ShiftedWindows(nn.Module):
    """timm's Swin ``WindowAttention`` as written without SDPA: A images x W windows of N tokens in the
    batch, a learned relative-position bias, then the shifted-window mask (0 / -100 per window) added on
    the scores split per window and merged back."""

    def __init__(self, windows, N, mask_shape=None):
        super().__init__()
        self.W, self.N = windows, N
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.rel = nn.Parameter(torch.randn(1, H, N, N) * 0.1)
        mask = (torch.rand(*(mask_shape or (windows, N, N))) < 0.3).float() * -100.0
        self.register_buffer("mask", mask)

    def forward(self, x):
        B_, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B_, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q * D ** -0.5) @ k.transpose(-2, -1) + self.rel
        m = self.mask.unsqueeze(1).unsqueeze(0) if self.mask.dim() == 3 else self.mask
        attn = attn.view(-1, self.W, H, N, N) + m
        attn = attn.view(-1, H, N, N).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B_, N, C))


def test_swin_shifted_window_mask_is_fused_and_exact():
    """The per-window mask on scores split as (A, W, H, N, N) becomes a bias of the merged (A*W) rows:
    every window's attention rewritten, the relative-position bias's gradient kept."""
    torch.manual_seed(0)
    rep = optimized_matches_eager(_ShiftedWindows(windows=3, N=9), torch.randn(2 * 3, 9, C))
    assert rep.count("attention") == 1, rep.render(width=120)


def test_window_bias_varying_per_image_is_declined_with_its_shape():
    """A bias on the split scores that differs per image (A, W, 1, N, N) is not read: declined, exact."""
    torch.manual_seed(0)
    rep = optimized_matches_eager(_ShiftedWindows(windows=3, N=9, mask_shape=(2, 3, 1, 9, 9)), torch.randn(6, 9, C))
    assert rep.count("attention") == 0
    assert any(d.pattern == "attention" and "split per window" in d.reason for d in rep.declines), rep.declines


class _UnequalHeadDims(nn.Module):
    """Q/K head dim ``dqk``, V head dim ``dv`` (DeepSeek's MLA: 192 / 128; LeViT: 16 / 64), written out or
    through SDPA, the output read back with ``transpose -> contiguous -> view`` (nanoGPT's spelling)."""

    def __init__(self, dqk, dv, sdpa):
        super().__init__()
        self.dqk, self.dv, self.sdpa = dqk, dv, sdpa
        self.qk, self.v = nn.Linear(C, 2 * H * dqk), nn.Linear(C, H * dv)
        self.proj = nn.Linear(H * dv, C)

    def forward(self, x):
        B, N, _ = x.shape
        q, k = self.qk(x).view(B, N, 2, H, self.dqk).permute(2, 0, 3, 1, 4).unbind(0)
        v = self.v(x).view(B, N, H, self.dv).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * self.dqk ** -0.5
            att = att.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
            y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(B, N, H * self.dv))


@pytest.mark.parametrize("dqk,dv", [(24, 16), (8, 20)])
@pytest.mark.parametrize("sdpa", [False, True])
def test_unequal_head_dims_are_zero_padded_and_exact(dqk, dv, sdpa):
    """The smaller head dim is zero-padded to the larger: rewritten, output and every gradient equal to
    eager, the report says so."""
    torch.manual_seed(0)
    rep = optimized_matches_eager(_UnequalHeadDims(dqk, dv, sdpa), torch.randn(3, 11, C))
    assert rep.count("attention") == 1, rep.render(width=120)
    assert f"head dims q/k {dqk}, v {dv}: zero-padded to {max(dqk, dv)}" in rep.matches[0].replacement
