"""The attention family's pass after matching (``src/opsmath/patterns/attention/backend.py``): the backend each
emitted ``opsmath::attention`` runs is chosen once every rule has applied."""
import copy
import math

import pytest
import torch
import torch.nn as nn

import opsmath


@pytest.mark.parametrize("padding", [False, True])
def test_backend_is_chosen_after_matching_and_may_swap_in_sdpa(monkeypatch, padding):
    """Matching always emits ``opsmath::attention``; the pass after matching asks the tuner, and where a
    vendor backend wins (forced here: the CPU tuner always answers "opsmath") the op becomes that SDPA
    call, mask folded into its bias, with the report saying so; the step still equals eager."""
    from opsmath.patterns.attention import backend as _attention_backend
    asked = []

    def tuner(q, k, bias_shape, mask_shape, *rest):
        asked.append((tuple(q.shape), mask_shape))
        return "sdpa_flash"
    monkeypatch.setattr(_attention_backend, "backend_for", tuner)
    torch.manual_seed(0)
    B, H, S, Dh = 2, 3, 9, 4
    D = H * Dh

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(D, 3 * D)

        def forward(self, x, keep):
            q, k, v = (t.view(B, S, H, Dh).transpose(1, 2) for t in self.proj(x).split(D, -1))
            att = q @ k.transpose(-2, -1) / math.sqrt(Dh)
            if padding:
                att = att.masked_fill(~keep[:, None, None, :], float("-inf"))
            return (att.softmax(-1) @ v).sum()
    ref = Attn()
    model = copy.deepcopy(ref)
    x = torch.randn(B, S, D)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, -3:] = False
    opt = opsmath.optimize(model, inductor=False)
    out, expect = opt(x, keep), ref(x, keep)
    out.backward()
    expect.backward()
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    rep = opsmath.report(opt)
    (m,) = [m for m in rep.matches if m.pattern == "attention"]
    assert asked and m.details["backend"] == "sdpa_flash"
    assert m.replacement.startswith("sdpa_flash(") and m.replacement.endswith("measured fastest")
    assert "opsmath.attention" not in rep.graphs[0].after_ops
