"""The attention rewrite where fusing would change what the code computes: probabilities read elsewhere, scores
written in place while something else reads them, a bias written after the attention, query rows widened by a
broadcast, a buffer of zeros changed through ``.data``. Each occurrence stays as written (or is fused only where
it is safe) and training equals eager. Shares its model and comparison with ``test_patterns_attention.py``."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opsmath
from attention_harness import AttnModel, D, H, T, _compare, _inputs
from tolerance import rel_err


def test_escaping_weights_are_declined_and_exact():
    def returns_probs(q, k, v, m):
        att = F.softmax((q @ k.transpose(-2, -1)) * D ** -0.5, dim=-1)
        m.last_weights = att.sum()  # the probabilities escape the subgraph
        return att @ v + 0 * m.last_weights

    torch.manual_seed(0)
    rep = _compare(AttnModel(returns_probs), *_inputs())
    assert rep.count("attention") == 0
    assert any("used outside" in d.reason for d in rep.declines), rep.declines


@pytest.mark.parametrize("read", ["before", "after"])
def test_scores_written_in_place_and_read_elsewhere_are_left_as_written(read):
    """``s.masked_fill_`` / ``s += b`` where something else reads ``s`` (before the write: its old values;
    after it: the new ones): fused, that reader would see the wrong scores, so the chain stays as written."""
    def spelling(q, k, v, m):
        s = q @ k.transpose(-2, -1)
        early = s.mean() if read == "before" else 0
        s.masked_fill_(~m.causal[:T, :T], float("-inf"))
        s += m.rel_bias
        late = (s > 0).float().mean() if read == "after" else 0
        return F.softmax(s, dim=-1) @ v + early + late

    torch.manual_seed(0)
    rep = _compare(AttnModel(spelling), *_inputs())
    assert rep.count("attention") == 0, rep.render(width=120)


def _widened(q, k, v, m):   # one query row broadcast over every row by a (T, T) bias of zeros
    a = (q[:, :, -1:] @ k.transpose(-2, -1)) * D ** -0.5 + torch.zeros(T, T)
    return (F.softmax(a, -1) @ v).sum(2, keepdim=True).expand(-1, -1, T, -1)


def _written_after(q, k, v, m):   # the bias written in place after the scores read it
    b = m.rel_bias.expand(q.shape[0], -1, -1, -1) * 1.0
    a = (q @ k.transpose(-2, -1)) * D ** -0.5
    a.add_(b)
    b.fill_(3.0)
    return F.softmax(a, -1) @ v + 0 * b.sum()


def _bias_written_later(q, k, v, m):   # the bias written in place after P V: eager's add kept no reference
    b = m.rel_bias.expand(q.shape[0], -1, -1, -1) * 1.0
    y = F.softmax((q @ k.transpose(-2, -1)) * D ** -0.5 + b, -1) @ v
    b.mul_(2.0)
    return y + b.sum()


def _beta_zero(q, k, v, m):   # baddbmm ignores its input at beta=0, NaN included
    B = q.shape[0]
    s = torch.baddbmm(torch.full((B * H, T, T), float("nan")), q.reshape(B * H, T, D),
                      k.reshape(B * H, T, D).transpose(-1, -2), beta=0, alpha=D ** -0.5)
    return (F.softmax(s, -1) @ v.reshape(B * H, T, D)).view(B, H, T, D)


class _ZeroBuffer(nn.Module):
    """A buffer of zeros added to the scores, changed between steps through ``.data`` (no version bump)."""

    def __init__(self):
        super().__init__()
        self.inner = AttnModel(lambda q, k, v, m: F.softmax(q @ k.transpose(-2, -1) + m.zb, -1) @ v)
        self.inner.register_buffer("zb", torch.zeros(1, H, T, T))

    def forward(self, x, pad):
        return self.inner(x, pad)


@pytest.mark.parametrize("fn,rewritten", [(_widened, False), (_written_after, False), (_bias_written_later, False),
                                        (_beta_zero, True)],
                         ids=["widened_rows", "written_after", "bias_written_later", "beta_zero"])
def test_scores_the_kernel_cannot_take_as_written_stay_exact(fn, rewritten):
    torch.manual_seed(0)
    rep = _compare(AttnModel(fn), *_inputs())
    assert rep.count("attention") == int(rewritten), rep.render(width=120)


def test_a_zero_buffer_bias_stays_a_bias():
    torch.manual_seed(0)
    model = _ZeroBuffer()
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    x, pad = _inputs()
    opt(x, pad)
    for m in (model, eager):
        m.inner.zb.data[..., 3] = -2.0
    assert rel_err(opt(x, pad), eager(x, pad)) < 1e-5
    assert opsmath.report(opt).matches[0].details["has_bias"]
