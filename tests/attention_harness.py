"""What the attention rewrite tests share: one attention layer with a pluggable spelling (``AttnModel``), its
inputs with padded rows (``_inputs``), and the check that ``optimize`` leaves outputs and gradients equal to
eager's, returning the report (``_compare``)."""
import copy

import torch
import torch.nn as nn

import opsmath
from tolerance import rel_err

T, C, H = 12, 32, 4
D = C // H


class AttnModel(nn.Module):
    def __init__(self, spelling, returns_weights=False):
        super().__init__()
        self.spelling = spelling
        self.returns_weights = returns_weights
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.drop = nn.Dropout(0.0)
        self.rel_bias = nn.Parameter(torch.randn(1, H, T, T) * 0.1)
        self.register_buffer("tril", torch.tril(torch.ones(T + 4, T + 4)).view(1, 1, T + 4, T + 4))
        self.register_buffer("causal", torch.ones(T + 4, T + 4, dtype=torch.bool).tril())
        self.pad = None

    def forward(self, x, pad):
        B = x.shape[0]
        self.pad = pad
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        y = self.spelling(q, k, v, self)
        out = self.proj(y.transpose(1, 2).reshape(B, T, C))
        return out


def _inputs():
    x = torch.randn(3, T, C)
    pad = torch.ones(3, T)
    pad[1, 9:] = 0
    pad[2, 5:] = 0
    return x, pad


def _compare(model, x, pad):
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    y1, y2 = opt(x, pad), eager(x, pad)
    w = torch.randn_like(y1)
    (y1 * w).sum().backward()
    (y2 * w).sum().backward()
    assert rel_err(y1, y2) < 1e-5
    for (name, p1), p2 in zip(opt.named_parameters(), eager.parameters()):
        if p2.grad is not None:
            assert rel_err(p1.grad, p2.grad) < 1e-4, name
    return opsmath.report(opt)
