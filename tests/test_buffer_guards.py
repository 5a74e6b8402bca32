"""A buffer whose value a rewrite read at capture (nanoGPT's ``tril`` mask) is guarded: changed in place
later, the step still equals eager's on the new value; rewritten with the same value (a reloaded
checkpoint), the optimized graph keeps running."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opsmath
from opsmath.capture.guards import BufferGuard, digest
from tolerance import grads_close


class MaskedAttention(nn.Module):
    """nanoGPT's attention: scores masked by a ``tril`` buffer read through ``== 0``."""

    def __init__(self, d=16, heads=2, block=12):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads
        self.register_buffer("mask", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        att = F.softmax(att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C)).square().mean()


def _step(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _same_step(eager, optimized, x):
    (le, ge), (lo, go) = _step(eager, x), _step(optimized, x)
    assert torch.allclose(lo, le, rtol=1e-5, atol=1e-6), (lo.item(), le.item())
    for n in ge:
        assert grads_close(go[n], ge[n], rtol=1e-4, atol=1e-6), n


def _pair():
    torch.manual_seed(0)
    eager = MaskedAttention()
    clone = MaskedAttention()
    clone.load_state_dict(eager.state_dict())
    return eager, opsmath.optimize(clone)


def test_mask_changed_in_place_after_capture_is_recaptured():
    eager, optimized = _pair()
    x = torch.randn(2, 12, 16)
    _same_step(eager, optimized, x)
    assert "attention" in {m.pattern for g in opsmath.report(optimized).graphs for m in g.matches}
    for m in (eager, optimized):   # full attention from now on
        m.mask.fill_(1.0)
    _same_step(eager, optimized, x)
    report = opsmath.report(optimized)
    assert any("buffer" in e and "changed after capture" in e for e in report.fallback_errors)
    # and a local window: the recaptured graph reads the new value
    for m in (eager, optimized):
        m.mask.copy_(torch.ones(12, 12).tril().triu(-3))
    _same_step(eager, optimized, x)


def test_same_value_written_again_keeps_the_optimized_graph():
    eager, optimized = _pair()
    x = torch.randn(2, 12, 16)
    _same_step(eager, optimized, x)
    optimized.load_state_dict(eager.state_dict())    # copies the same mask in place
    _same_step(eager, optimized, x)
    report = opsmath.report(optimized)
    assert not report.fallback_errors
    assert len(report.graphs) == 1


def test_buffer_rebound_to_another_tensor_is_seen():
    eager, optimized = _pair()
    x = torch.randn(2, 12, 16)
    _same_step(eager, optimized, x)
    for m in (eager, optimized):
        m.mask = torch.ones(1, 1, 12, 12)
    _same_step(eager, optimized, x)


@pytest.mark.parametrize("t", [torch.ones(()), torch.arange(6.).view(2, 3).t(), torch.ones(0, 3),
                               torch.tensor([True, False])], ids=["0d", "strided", "empty", "bool"])
def test_digest_tells_values_shapes_and_dtypes_apart(t):
    assert digest(t) == digest(t.clone()) == digest(t.contiguous())
    assert digest(t) != digest(t.to(torch.float64))
    if t.numel():
        changed = t.contiguous().clone()
        changed.view(-1)[0] = 1 - changed.view(-1)[0] if t.dtype != torch.bool else ~changed.view(-1)[0]
        assert digest(changed) != digest(t)


def test_guard_refreshes_its_stamp_on_a_same_value_write():
    buf = torch.tril(torch.ones(4, 4))
    guard = BufferGuard([0], ["mask"], [buf])
    buf.copy_(buf.clone())
    assert guard.changed([buf]) == [] and guard.stamps[0][1] == buf._version
    buf[0, 1] = 1
    assert guard.changed([buf]) == ["mask"]


def test_mask_changed_under_changing_lengths_runs_as_written_or_recaptured():
    eager, optimized = _pair()
    for T in (12, 9, 7):    # the second length makes the graph's sizes symbolic
        _same_step(eager, optimized, torch.randn(2, T, 16))
    for m in (eager, optimized):
        m.mask.fill_(1.0)
    for T in (12, 9, 7):
        _same_step(eager, optimized, torch.randn(2, T, 16))
