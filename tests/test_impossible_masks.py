"""``normalize.impossible_masks``: a fill under a mask that top-k indices make false everywhere is dropped
(Hugging Face's grouped experts in transformers 5.17 mask expert-parallel sentinels, ``ids >= E``, on every
call); a mask that can be true, or indices written in place before the comparison, keep the fill."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opsmath
from tolerance import rel_err

pytestmark = pytest.mark.quick


class SentinelExperts(nn.Module):
    """transformers 5.17's grouped experts forward, a per-row matmul with the expert's stacked weight in
    place of ``torch._grouped_mm``: rows sorted by expert, ``ids >= E`` masks on the gathered rows (in
    place), the first product and the second; the sorted indices clamped in place after the mask, and the
    router's dense scores scattered by the indices, as 5.17 does. ``variant``: ``threshold inside the
    range`` compares with E - 2; ``indices written before the mask`` adds E to them in place first;
    ``mask or-ed in place`` ORs another mask into it before the fills (each keeps the fills)."""

    def __init__(self, d=24, h=40, E=5, k=2, variant="as in transformers 5.17"):
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        self.up = nn.Parameter(torch.randn(E, d, h) * d ** -0.5)
        self.down = nn.Parameter(torch.randn(E, h, d) * h ** -0.5)
        self.E, self.k, self.variant = E, k, variant

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, self.k, dim=-1)
        scores = torch.zeros_like(probs).scatter_(1, idx, w)     # the router's dense scores (read-only use)
        ids, perm = torch.sort(idx.reshape(-1))
        if self.variant == "indices written before the mask":
            ids.add_(self.E)
        rows = x[perm // self.k] + 0 * scores.sum()
        sentinel = (ids >= (self.E - 2 if self.variant == "threshold inside the range" else self.E)).unsqueeze(-1)
        if self.variant == "mask or-ed in place":
            sentinel |= rows[:, :1] > 0
        ids.clamp_(max=self.E - 1)
        rows.masked_fill_(sentinel, 0.0)
        h = torch.bmm(rows.unsqueeze(1), self.up[ids]).squeeze(1)
        h = F.silu(h.masked_fill(sentinel, 0.0))
        y = torch.bmm(h.unsqueeze(1), self.down[ids]).squeeze(1)
        y = y.masked_fill(sentinel, 0.0) * w.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        return y[inverse].view(B * T, self.k, D).sum(1).view(B, T, D)


def _run(model, x):
    out = model(x)
    out.square().mean().backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def _fills(model, x):
    """The optimized copy's output and gradients, and the masked fills before and after rewriting."""
    opt = opsmath.optimize(copy.deepcopy(model))
    out, grads = _run(opt, x)
    g = opsmath.report(opt).graphs[0]
    count = lambda ops: sum(v for k, v in ops.items() if "masked_fill" in str(k))   # noqa: E731
    return out, grads, count(g.before_ops), count(g.after_ops)


@pytest.mark.parametrize("T", [7, 16])
def test_sentinel_fills_dropped_and_training_unchanged(T):
    torch.manual_seed(T)
    model, x = SentinelExperts(), torch.randn(2, T, 24)
    ref, ref_grads = _run(copy.deepcopy(model), x)
    out, grads, before, after = _fills(model, x)
    assert before == 3 and after == 0
    assert rel_err(out, ref) < 1e-6
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) < 1e-5, name


@pytest.mark.parametrize("variant", ["threshold inside the range", "indices written before the mask",
                                     "mask or-ed in place"])
def test_fills_kept_where_the_mask_can_be_true(variant):
    torch.manual_seed(0)
    model = SentinelExperts(variant=variant)
    x = torch.randn(2, 9, 24)
    ref, ref_grads = _run(copy.deepcopy(model), x)
    out, grads, before, after = _fills(model, x)
    assert before == after == 3
    assert rel_err(out, ref) < 1e-6
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) < 1e-5, name
