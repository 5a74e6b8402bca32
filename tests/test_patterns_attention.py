"""The attention rewrite on the spellings real code uses: each must be found, rewritten to opsmath::attention,
and leave outputs and gradients equal to eager (the layer and the check: ``attention_harness.py``)."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opsmath
from attention_harness import C, D, H, T, AttnModel, _compare, _inputs
from tolerance import rel_err


def repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


# Each spelling: (q, k, v, m) -> y (B, H, T, D); m is the module (buffers, pad masks).
def mul_scale(q, k, v, m):
    return F.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1))), dim=-1) @ v


def div_sqrt(q, k, v, m):
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D), -1), v)


def scale_on_q(q, k, v, m):
    q = q * D ** -0.5
    return (q @ k.transpose(2, 3)).softmax(dim=-1) @ v


def scale_on_k(q, k, v, m):
    return F.softmax(q @ (k * 0.3).transpose(-2, -1), dim=-1) @ v


def no_scale_permute(q, k, v, m):
    return F.softmax(q @ k.permute(0, 1, 3, 2), dim=-1) @ v


def bmm_3d(q, k, v, m):
    B = q.shape[0]
    q3, k3, v3 = (t.reshape(B * H, T, D) for t in (q, k, v))
    att = torch.bmm(q3, k3.transpose(1, 2)) * D ** -0.5
    return torch.bmm(F.softmax(att, dim=-1), v3).view(B, H, T, D)


def tril_masked_fill(q, k, v, m):
    att = (q @ k.transpose(-2, -1)) * D ** -0.5
    att = att.masked_fill(m.tril[:, :, :T, :T] == 0, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def where_causal_min(q, k, v, m):
    att = (q @ k.transpose(-2, -1)) * D ** -0.5
    att = torch.where(m.causal[:T, :T], att, torch.finfo(att.dtype).min)
    return F.softmax(att, dim=-1) @ v


def additive_finfo_padding(q, k, v, m):
    mask = (1.0 - m.pad[:, None, None, :].float()) * torch.finfo(torch.float32).min
    return F.softmax(q @ k.transpose(-2, -1) / math.sqrt(D) + mask, dim=-1) @ v


def bool_padding_masked_fill(q, k, v, m):
    att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    att = att.masked_fill(~m.pad.bool()[:, None, None, :], float("-inf"))
    return F.softmax(att, dim=-1) @ v


def causal_plus_padding(q, k, v, m):
    att = (q @ k.transpose(-2, -1)) * D ** -0.5
    att = att.masked_fill(m.tril[:, :, :T, :T] == 0, float("-inf"))
    att = att + (1.0 - m.pad[:, None, None, :].float()) * -10000.0
    return F.softmax(att, dim=-1) @ v


def softmax_fp32_cast_back(q, k, v, m):
    att = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
    return torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), v)


def float_then_type_as(q, k, v, m):
    return F.softmax((q @ k.transpose(-2, -1)).float() * D ** -0.5, dim=-1).type_as(q) @ v


def dropout_function(q, k, v, m):
    att = F.softmax((q @ k.transpose(-2, -1)) * D ** -0.5, dim=-1)
    return F.dropout(att, p=0.0, training=m.training) @ v


def dropout_module(q, k, v, m):
    return m.drop(F.softmax((q @ k.transpose(-2, -1)) * D ** -0.5, dim=-1)) @ v


def hf_eager_style(q, k, v, m):
    """transformers' eager_attention_forward with a float causal mask built from arange."""
    idx = torch.arange(T, device=q.device)
    causal = torch.where(idx[None, :] <= idx[:, None], 0.0, torch.finfo(torch.float32).min)[None, None]
    att = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + causal
    att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(att, p=0.0, training=m.training), v)


def triu_neg_inf_float_mask(q, k, v, m):
    mask = torch.full((T, T), float("-inf"), device=q.device).triu(1)
    return F.softmax((q @ k.transpose(-2, -1)) * D ** -0.5 + mask, dim=-1) @ v


def gqa_repeat_kv(q, k, v, m):
    k, v = repeat_kv(k[:, :2], 2), repeat_kv(v[:, :2], 2)
    return F.softmax((q @ k.transpose(-2, -1)) * D ** -0.5, dim=-1) @ v


def gqa_repeat_interleave(q, k, v, m):
    k, v = k[:, :1].repeat_interleave(H, dim=1), v[:, :1].repeat_interleave(H, dim=1)
    return F.softmax((q @ k.transpose(-2, -1)) * D ** -0.5, dim=-1) @ v


def mqa_expand(q, k, v, m):
    k, v = k[:, :1].expand(-1, H, -1, -1), v[:, :1].expand(-1, H, -1, -1)
    return F.softmax((q @ k.transpose(-2, -1)) * D ** -0.5, dim=-1) @ v


def relative_bias_learned(q, k, v, m):
    return F.softmax((q @ k.transpose(-2, -1)) * D ** -0.5 + m.rel_bias, dim=-1) @ v


def einsum_both(q, k, v, m):
    att = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(D)
    return torch.einsum("bhqk,bhkd->bhqd", att.softmax(-1), v)


def einsum_causal_other_letters(q, k, v, m):
    att = torch.einsum("nhid,nhjd->nhij", q * D ** -0.5, k).masked_fill(m.tril[:, :, :T, :T] == 0, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def sdpa_plain(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_is_causal_scale(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2)


def sdpa_bool_tril(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m.causal[:T, :T])


def sdpa_bool_padding(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m.pad[:, None, None, :].bool())


def sdpa_additive_padding(q, k, v, m):
    bias = (1.0 - m.pad[:, None, None, :]) * torch.finfo(q.dtype).min
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def sdpa_enable_gqa(q, k, v, m):
    return F.scaled_dot_product_attention(q, k[:, ::2], v[:, ::2], is_causal=True, enable_gqa=True)


def sdpa_repeat_kv(q, k, v, m):
    return F.scaled_dot_product_attention(q, repeat_kv(k[:, ::2], 2), repeat_kv(v[:, ::2], 2), is_causal=True)


def baddbmm_alibi(q, k, v, m):
    """BLOOM's eager attention: ALiBi folded into the score GEMM with baddbmm."""
    B = q.shape[0]
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)])
    alibi = (slopes[:, None] * torch.arange(T)[None, :]).repeat(B, 1)[:, None, :]
    s = alibi.baddbmm(q.reshape(B * H, T, D), k.reshape(B * H, T, D).transpose(1, 2), beta=1.0, alpha=D ** -0.5)
    s = s.view(B, H, T, T).masked_fill(~m.causal[:T, :T], torch.finfo(torch.float32).min)
    return (F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v)


def falcon_alibi_inplace(q, k, v, m):
    """Falcon's eager ALiBi path: a no-op view of the scores, ALiBi added, the scale applied in place."""
    B = q.shape[0]
    s = (q @ k.transpose(-1, -2)).view(B, H, T, T)
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)])
    s = s + (slopes[:, None, None] * torch.arange(T)[None, None, :]).view(1, H, 1, T)
    s *= D ** -0.5
    return F.softmax(s, dim=-1).view(B, H, T, T) @ v


def deberta_rows(q, k, v, m):
    """DeBERTa's spelling: (B*H)-row ``bmm`` with K divided by a constant tensor, a learned relative bias
    added before the view to 4-D, the mask filled there, and ``bmm`` with the rows again."""
    B = q.shape[0]
    q3, k3, v3 = (t.reshape(B * H, T, D) for t in (q, k, v))
    scale = torch.sqrt(torch.tensor(D, dtype=torch.float) * 3)
    s = torch.bmm(q3, k3.transpose(-1, -2) / scale.to(q.dtype)) + m.rel_bias[0, :, :T, :T].repeat(B, 1, 1)
    s = s.view(-1, H, T, T).masked_fill(~(m.pad[:, None, None, :] > 0), torch.finfo(q.dtype).min)
    return torch.bmm(F.softmax(s, dim=-1).view(-1, T, T), v3).view(B, H, T, D)


def _alibi():
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)])
    return (slopes[:, None, None] * torch.arange(T)[None, None, :]).view(1, H, 1, T)


def where_mask_and_alibi(q, k, v, m):
    """HF's eager mask ``where(keep, 0, finfo.min)`` added after an ALiBi bias; with padding it is not
    causal and stays an additive bias (a fully masked row passes gradients in eager)."""
    keep = m.causal[:T, :T] & (m.pad[:, None, None, :] > 0)
    s = q @ k.transpose(-1, -2) * D ** -0.5 + _alibi()
    s = s + torch.where(keep, torch.zeros(()), torch.finfo(torch.float32).min)
    return F.softmax(s, dim=-1) @ v


def where_causal_and_alibi(q, k, v, m):
    s = q @ k.transpose(-1, -2) * D ** -0.5 + _alibi()
    s = s + torch.where(m.causal[:T, :T], torch.zeros(()), torch.finfo(torch.float32).min)
    return F.softmax(s, dim=-1) @ v


def t5_zero_position_bias(q, k, v, m):
    """T5's cross-attention: a position bias of zeros (no relative attention bias in that layer) added in place."""
    scores = torch.matmul(q, k.transpose(3, 2))
    scores += torch.zeros((1, H, T, T), device=q.device, dtype=scores.dtype)
    return torch.matmul(F.softmax(scores.float(), dim=-1).type_as(scores), v)


def inplace_learned_bias(q, k, v, m):
    """Older T5's self-attention: a learned position bias added to the scores in place."""
    scores = torch.matmul(q, k.transpose(3, 2))
    scores += m.rel_bias
    return torch.matmul(F.softmax(scores.float(), dim=-1).type_as(scores), v)


def inplace_masked_fill(q, k, v, m):
    """``scores.masked_fill_(~causal, -inf)`` and a padding ``masked_fill_`` in place (lucidrains-style blocks)."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    s.masked_fill_(~m.causal[:T, :T], float("-inf"))
    s.masked_fill_(m.pad[:, None, None, :] == 0, float("-inf"))
    return F.softmax(s, dim=-1) @ v


SPELLINGS = {  # name: (fn, causal expected, bias expected, mask expected)
    "mul_scale": (mul_scale, False, False, False),
    "div_sqrt": (div_sqrt, False, False, False),
    "scale_on_q": (scale_on_q, False, False, False),
    "scale_on_k": (scale_on_k, False, False, False),
    "no_scale_permute": (no_scale_permute, False, False, False),
    "bmm_3d": (bmm_3d, False, False, False),
    "tril_masked_fill": (tril_masked_fill, True, False, False),
    "where_causal_min": (where_causal_min, True, False, False),
    "additive_finfo_padding": (additive_finfo_padding, False, True, False),
    "bool_padding_masked_fill": (bool_padding_masked_fill, False, False, True),
    "causal_plus_padding": (causal_plus_padding, True, True, False),
    "softmax_fp32_cast_back": (softmax_fp32_cast_back, False, False, False),
    "float_then_type_as": (float_then_type_as, False, False, False),
    "dropout_function": (dropout_function, False, False, False),
    "dropout_module": (dropout_module, False, False, False),
    "hf_eager_style": (hf_eager_style, True, False, False),
    "triu_neg_inf_float_mask": (triu_neg_inf_float_mask, True, False, False),
    "gqa_repeat_kv": (gqa_repeat_kv, False, False, False),
    "gqa_repeat_interleave": (gqa_repeat_interleave, False, False, False),
    "mqa_expand": (mqa_expand, False, False, False),
    "relative_bias_learned": (relative_bias_learned, False, True, False),
    "einsum_both": (einsum_both, False, False, False),
    "einsum_causal_other_letters": (einsum_causal_other_letters, True, False, False),
    "sdpa_plain": (sdpa_plain, False, False, False),
    "sdpa_is_causal_scale": (sdpa_is_causal_scale, True, False, False),
    "sdpa_bool_tril": (sdpa_bool_tril, True, False, False),
    "sdpa_bool_padding": (sdpa_bool_padding, False, False, True),
    "sdpa_additive_padding": (sdpa_additive_padding, False, True, False),
    "sdpa_enable_gqa": (sdpa_enable_gqa, True, False, False),
    "sdpa_repeat_kv": (sdpa_repeat_kv, True, False, False),
    "falcon_alibi_inplace": (falcon_alibi_inplace, False, True, False),
    "bloom_baddbmm_alibi": (baddbmm_alibi, True, True, False),
    "where_mask_and_alibi": (where_mask_and_alibi, False, True, False),
    "where_causal_and_alibi": (where_causal_and_alibi, True, True, False),
    "deberta_rows": (deberta_rows, False, True, True),
    "t5_zero_position_bias": (t5_zero_position_bias, False, False, False),   # zeros: no bias
    "inplace_learned_bias": (inplace_learned_bias, False, True, False),
    "inplace_masked_fill": (inplace_masked_fill, True, False, True),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_is_rewritten_and_exact(name):
    fn, causal, bias, mask = SPELLINGS[name]
    torch.manual_seed(0)
    rep = _compare(AttnModel(fn), *_inputs())
    assert rep.count("attention") == 1, rep.render(width=120)
    d = rep.matches[0].details
    assert (d["causal"], d["has_bias"], d["has_mask"]) == (causal, bias, mask), d
    # K/V repeated to every query head (repeat_kv, repeat_interleave, an MQA expand) are read per kv head
    assert d["gqa_rep"] == {"gqa_repeat_kv": 2, "gqa_repeat_interleave": H, "mqa_expand": H,
                            "sdpa_enable_gqa": 2, "sdpa_repeat_kv": 2}.get(name, 1), d


def test_skip_leaves_attention_alone():
    torch.manual_seed(0)
    model = AttnModel(mul_scale)
    opt = opsmath.optimize(model, skip=["attention"])
    opt(*_inputs())
    rep = opsmath.report(opt)
    assert rep.count("attention") == 0 and rep.declines[0].reason == "skipped by the user"


def test_softmax_over_other_dim_is_not_attention():
    def odd(q, k, v, m):
        return F.softmax(q @ k.transpose(-2, -1), dim=-2) @ v

    torch.manual_seed(0)
    rep = _compare(AttnModel(odd), *_inputs())
    assert rep.count("attention") == 0


@pytest.mark.parametrize("make", [
    lambda: nn.TransformerEncoderLayer(C, H, 2 * C, dropout=0.0, batch_first=True),
    lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(C, H, 2 * C, dropout=0.0, batch_first=True,
                                                             norm_first=True), 2, enable_nested_tensor=False),
    lambda: nn.Sequential(nn.Linear(C, C), nn.TransformerEncoderLayer(C, H, 2 * C, dropout=0.0, batch_first=True)),
], ids=["encoder_layer", "encoder_pre_ln", "sequential"])
def test_torch_nn_containers_are_captured_and_their_attention_rewritten(make):
    """A torch.nn module passed to optimize directly (its forward lives in torch/, which dynamo skips as a
    top-level frame) is captured; nn.MultiheadAttention's SDPA call inside is rewritten."""
    torch.manual_seed(0)
    model = make()
    layers = sum(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    x = torch.randn(2, T, C)
    y, ye = opt(x), eager(x)
    w = torch.randn_like(y)   # (a sum of squares after a final LayerNorm is constant: its gradient is noise)
    (y * w).sum().backward()
    (ye * w).sum().backward()
    rep = opsmath.report(opt)
    assert rep.graphs and rep.count("attention") == layers, rep.render(width=120)
    assert rel_err(y, ye) < 1e-5
    for (name, p), pe in zip(opt.named_parameters(), eager.parameters()):
        assert rel_err(p.grad, pe.grad) < 1e-4, name


def test_sdpa_output_layout_is_kept_for_a_view_after_it():
    """nanoGPT's SDPA path: ``y.transpose(1, 2).contiguous().view(B, T, C)``. SDPA returns [B, H, T, D]
    laid out as [B, T, H, D], so the capture drops the no-op ``contiguous`` and the ``view`` needs that
    layout; the kernel's contiguous [B, H, T, D] output is copied into it (one permuted clone), not
    handed to the ``view`` (which raised). Exact vs eager; no copy where the layouts already agree
    (the written-out spellings, whose ``matmul`` output is contiguous)."""
    class ViewAfterSDPA(AttnModel):
        def forward(self, x, pad):
            B = x.shape[0]
            q, k, v = self.qkv(x).split(C, dim=2)
            q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))

    torch.manual_seed(0)
    rep = _compare(ViewAfterSDPA(None), *_inputs())
    assert rep.count("attention") == 1 and "aten.clone" in rep.graphs[0].after_code.replace(".default", "")
    torch.manual_seed(0)
    rep = _compare(AttnModel(mul_scale), *_inputs())
    assert rep.count("attention") == 1 and "clone" not in rep.graphs[0].after_code


class _MHA(nn.Module):
    """``nn.MultiheadAttention`` called as users write it, its weights asked for (the default): a float causal
    mask goes into one ``baddbmm`` over (B*H) rows; a key padding mask built in ``forward`` with a
    write through a view (``kpm[1, 7:] = True``) must stay a run-time bias."""

    def __init__(self, causal: bool, pad: bool):
        super().__init__()
        self.attn, self.causal, self.pad = nn.MultiheadAttention(C, H, batch_first=True), causal, pad

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1]) if self.causal else None
        kpm = None
        if self.pad:
            kpm = torch.zeros(x.shape[0], x.shape[1])
            kpm[1, 7:] = float("-inf")
        return x + self.attn(x, x, x, attn_mask=mask, key_padding_mask=kpm)[0]


@pytest.mark.parametrize("causal,pad,read", [(True, False, (True, False)), (False, True, (False, True)),
                                             (True, True, (False, True))])   # both: one run-time bias, summed
def test_multihead_attention_with_masks_and_weights_is_rewritten_and_exact(causal, pad, read):
    torch.manual_seed(0)
    model = _MHA(causal, pad)
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    x = torch.randn(2, T, C)
    y, ye = opt(x), eager(x)
    w = torch.randn_like(y)
    (y * w).sum().backward()
    (ye * w).sum().backward()
    rep = opsmath.report(opt)
    assert rep.count("attention") == 1, rep.render(width=120)
    d = rep.matches[0].details
    assert (d["causal"], d["has_bias"]) == read, d
    assert rel_err(y, ye) < 1e-5
    for (name, p), pe in zip(opt.named_parameters(), eager.parameters()):
        assert rel_err(p.grad, pe.grad) < 1e-4, name
