"""Attention spellings found in third-party model code: a debugging copy of the scores nothing reads,
einsum in (batch, seq, head, dim) layout, ``.type_as(scores)`` after the softmax, and ``nn.MultiheadAttention`` with a boolean ``triu`` mask. Rewritten and exact (models and helpers: ``test_patterns_attention``)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opsmath

from attention_harness import D, T, AttnModel, _compare, _inputs
from tolerance import rel_err


def dead_debug_clone(q, k, v, m):
    """A copy of the masked scores kept in a variable nothing reads (a library's debugging leftover)."""
    att = (q @ k.transpose(-2, -1)) * D ** -0.5
    att = att.masked_fill(m.tril[:, :, :T, :T] == 0, float("-inf"))
    saved = att.clone()  # noqa: F841
    return F.softmax(att, dim=-1) @ v


def einsum_bqhd(q, k, v, m):
    """einsum in (batch, seq, head, dim) layout, as some libraries write attention."""
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    att = torch.einsum("bqhd,bkhd->bhqk", qs, ks) * D ** -0.5
    out = torch.einsum("bhqk,bkhd->bqhd", F.softmax(att, dim=-1), vs)
    return out.transpose(1, 2)


def softmax_type_as_scores(q, k, v, m):
    """fairseq / ESM: ``softmax(scores, dtype=float32).type_as(scores)`` (the scores read for their dtype)."""
    att = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)) * D ** -0.5
    probs = F.softmax(att, dim=-1, dtype=torch.float32).type_as(att)
    return torch.bmm(probs, v.flatten(0, 1)).view(q.shape)


HELD_OUT = {"dead_debug_clone": (dead_debug_clone, True), "einsum_bqhd": (einsum_bqhd, False),
            "softmax_type_as_scores": (softmax_type_as_scores, False)}


@pytest.mark.parametrize("name", list(HELD_OUT))
def test_held_out_spelling_is_rewritten_and_exact(name):
    fn, causal = HELD_OUT[name]
    torch.manual_seed(0)
    rep = _compare(AttnModel(fn), *_inputs())
    assert rep.count("attention") == 1, rep.render(width=120)
    assert rep.matches[0].details["causal"] == causal


class TriuMaskedMHA(nn.Module):
    """``nn.MultiheadAttention`` given the boolean causal mask built in ``forward`` (True = not attended), which it
    turns into a bias with ``zeros_like(mask).masked_fill_(mask, -inf)``: read as causal, not as a T x T bias."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        T_ = x.shape[1]
        mask = torch.triu(torch.ones(T_, T_, dtype=torch.bool, device=x.device), diagonal=1)
        return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]


def test_multihead_attention_with_a_triu_bool_mask_is_causal_and_exact():
    torch.manual_seed(0)
    model, x = TriuMaskedMHA(), torch.randn(2, 19, 32)
    eager, opt = copy.deepcopy(model), opsmath.optimize(model)
    y1, y2 = opt(x), eager(x)
    w = torch.randn_like(y1)
    (y1 * w).sum().backward()
    (y2 * w).sum().backward()
    assert rel_err(y1, y2) < 1e-5
    for p1, p2 in zip(opt.parameters(), eager.parameters()):
        assert rel_err(p1.grad, p2.grad) < 1e-4
    rep = opsmath.report(opt)
    assert rep.count("attention") == 1 and rep.matches[0].details["causal"], rep.render(width=120)
    assert not rep.matches[0].details["has_bias"]
