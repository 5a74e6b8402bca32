"""Changes a training loop makes to the model between steps, after its graphs were captured: module
hooks added and removed, parameters frozen and unfrozen, a parameter object replaced. Each must take
effect from the next call on, exactly as in eager (bitwise on CPU without rewrites; the rule on the GPU).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opsmath
from conftest import DEVICE
from idioms_base import MLP
from test_semantics import MODES, _same

HOOKS = {"forward": lambda m: m.a.register_forward_hook(lambda mod, args, out: out * 0.5 + 1),
         "forward_pre": lambda m: m.b.register_forward_pre_hook(lambda mod, args: (args[0] * 2,)),
         "full_backward": lambda m: m.b.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 0.25,))}


def _freeze(m, step):
    for p in m.a.parameters():
        p.requires_grad_(step not in (1, 2))


def _replace(m, step):
    if step == 2:
        m.b.weight = nn.Parameter(torch.linspace(-1, 1, m.b.weight.numel()).view_as(m.b.weight).to(m.b.weight))


def _train(optimized: bool, change):
    """Losses and final parameters of 4 SGD steps; ``change(model, step)`` runs before each step."""
    torch.manual_seed(0)
    model = MLP(lambda m, h: torch.relu(h)).to(DEVICE)
    inner = model
    model = opsmath.optimize(model, patterns=[]) if optimized else model
    losses = []
    for step in range(4):
        change(inner, step)
        params = [p for p in model.parameters() if p.requires_grad]
        loss = model(torch.randn(3, 8, device=DEVICE)).square().mean()
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= 0.05 * p.grad
                p.grad = None
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def _compare(change):
    torch._dynamo.reset()
    want, got = _train(False, change), _train(True, change)
    mode = "exact" if MODES[False] == "exact" else "fp32"
    _same(want[0], got[0], mode, "losses", rtol=1e-2)
    _same(want[1], got[1], mode, "parameters", rtol=1e-2)


@pytest.mark.parametrize("kind", sorted(HOOKS))
def test_module_hooks_added_and_removed_between_steps_take_effect(kind):
    """A hook registered on a submodule after capture (a probe, a LoRA scale, gradient surgery) runs from
    the next call on and stops when removed: dynamo skips guarding on module hooks by default, which
    kept running the graph captured without it."""
    handles = {}

    def change(m, step):
        if step == 1:
            handles["h"] = HOOKS[kind](m)
        if step == 3:
            handles["h"].remove()
    _compare(change)


def test_parameters_frozen_and_unfrozen_between_steps():
    _compare(_freeze)


def test_a_parameter_replaced_between_steps_is_read():
    _compare(_replace)
