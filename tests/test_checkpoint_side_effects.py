"""A checkpointed region whose body writes Python state, as transformers 5's layers do (each sets and resets
the ``kernels`` package's context variable): dynamo's checkpoint refuses such a body by default ("HOP: Unsafe
side effect", a graph break: the layers run eagerly, as under ``torch.compile``). opsmath traces it: the body is
rewritten, still recomputed in backward, training equals eager, and the side effects run once, in forward (eager
runs them again in the recompute), as the report's checkpoint rows say. (A counter or a list appended to
there would recompile at every step, under ``torch.compile`` too: dynamo guards on what it mutates.)"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import opsmath
from tolerance import grads_close


ACTIVE = {}   # a module-level registry each layer's body sets and restores (as ``kernels``' context variable)


def _set(value):
    previous, ACTIVE["kernels"] = ACTIVE.get("kernels"), value
    return previous


class _Layer(nn.Module):
    def __init__(self, c=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(c, 3 * c), nn.Linear(c, c)

    def forward(self, x):
        token = _set({"layer": self.heads})
        try:
            B, T, C = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        finally:
            ACTIVE["kernels"] = token


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


def test_a_checkpointed_body_with_python_side_effects_is_rewritten_and_trains_as_eager():
    torch.manual_seed(0)
    eager = _Model()
    model = copy.deepcopy(eager)
    opt = opsmath.optimize(model)
    steps = 3
    for _ in range(steps):
        x = torch.randn(2, 16, 32)
        eager(x).square().sum().backward()
        opt(x).square().sum().backward()
        assert ACTIVE["kernels"] is None
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert grads_close(p.grad, q.grad, 1e-5), name
    rep = opsmath.report(opt)
    assert rep.count("attention") == 2 and not any("Unsafe side effect" in r.reason for r in rep.eager_regions), \
        rep.render(width=140)
    rows = [r for r in rep.eager_regions if r.kind == "checkpoint"]
    assert rows and all("side effects in it run once" in r.reason for r in rows), rows
    if not any(g.inductor for g in rep.graphs):   # op by op: the checkpointed bodies run again in backward
        assert any(g.calls >= 2 * steps and g.matches for g in rep.graphs), [(g.calls, g.matches) for g in rep.graphs]
