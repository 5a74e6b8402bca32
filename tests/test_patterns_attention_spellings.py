"""Attention spellings found in third-party model code: a debugging copy of the scores nothing reads, and
einsum in (batch, seq, head, dim) layout. Rewritten and exact (models and helpers: ``test_patterns_attention``)."""
import pytest
import torch
import torch.nn.functional as F

from test_patterns_attention import D, T, AttnModel, _compare, _inputs


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


HELD_OUT = {"dead_debug_clone": (dead_debug_clone, True), "einsum_bqhd": (einsum_bqhd, False)}


@pytest.mark.parametrize("name", list(HELD_OUT))
def test_held_out_spelling_is_rewritten_and_exact(name):
    fn, causal = HELD_OUT[name]
    torch.manual_seed(0)
    rep = _compare(AttnModel(fn), *_inputs())
    assert rep.count("attention") == 1, rep.render(width=120)
    assert rep.matches[0].details["causal"] == causal
