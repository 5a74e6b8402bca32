"""Shared pieces of the differential semantics suite (``test_semantics.py``): the idiom registry, the
small model most idioms put their construct into, per-step batches, and how an output becomes a loss."""
from __future__ import annotations

import torch
import torch.nn as nn

IDIOMS = {}


def idiom(fn):
    IDIOMS[fn.__name__] = fn
    return fn


def _batches(*shape, steps=3, requires_grad=False):
    return [(torch.randn(*shape, requires_grad=requires_grad),) for _ in range(steps)]


class MLP(nn.Module):
    """``in -> Linear -> mid(h) -> Linear -> out``; ``mid`` is what an idiom puts in between."""

    def __init__(self, mid, d_in=8, d_hid=16, d_out=4):
        super().__init__()
        self.a, self.b, self.mid = nn.Linear(d_in, d_hid), nn.Linear(d_hid, d_out), mid
        self.log = []

    def forward(self, x):
        return self.b(self.mid(self, self.a(x)))


def reduce_output(out) -> torch.Tensor:
    """A scalar loss from any model output: tensors (floating ones), tuples, lists, dicts, ModelOutput."""
    if isinstance(out, torch.Tensor):
        return (out.float() * torch.linspace(0.5, 1.5, out.numel(), device=out.device).view_as(out)).sum() \
            if out.is_floating_point() and out.requires_grad else out.new_zeros((), dtype=torch.float32)
    if isinstance(out, dict) or hasattr(out, "to_tuple"):
        values = list(out.values())
    elif isinstance(out, (tuple, list)):
        values = list(out)
    else:
        return torch.zeros(())
    return sum((reduce_output(v) for v in values), torch.zeros(()))


class Checkpointed(nn.Module):
    """``block`` under ``torch.utils.checkpoint`` (non-reentrant), as a model that checkpoints its own
    layers wraps them."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
