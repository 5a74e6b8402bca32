"""Idioms of grad modes, in-place ops, parameters and buffers, graph breaks, checkpoint and outputs."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from idioms_autograd import GradReverse
from idioms_base import MLP, _batches, idiom


# ---- grad modes, detach, in-place ---------------------------------------------------------------
def _no_grad_target(m, h):
    with torch.no_grad():
        t = torch.tanh(m.a.weight.sum() * h)
    return h * t


@idiom
def no_grad_region():
    return MLP(_no_grad_target), _batches(3, 8)


def _enable_inside_no_grad(m, h):
    with torch.no_grad():
        s = h * 3
        with torch.enable_grad():
            e = h * 2
    return s + e


@idiom
def enable_grad_inside_no_grad():
    return MLP(_enable_inside_no_grad), _batches(3, 8)


@idiom
def detach_stop_gradient():
    return MLP(lambda m, h: h * torch.sigmoid(h).detach()), _batches(3, 8)


@idiom
def straight_through_detach_trick():
    return MLP(lambda m, h: h + (torch.round(h) - h).detach()), _batches(3, 8)


def _inplace(m, h):
    h = h * 1.0
    h.add_(1.0)
    h[:, :3] *= 0.5
    h.sigmoid_()
    return h


@idiom
def inplace_on_activations():
    return MLP(_inplace), _batches(3, 8)


def _masked_fill_inplace(m, h):
    h = h * 2.0
    h.masked_fill_(h < -0.2, 0.0)
    return h


@idiom
def inplace_masked_fill():
    return MLP(_masked_fill_inplace), _batches(3, 8)


@idiom
def input_requires_grad():
    """Gradients w.r.t. the input (saliency, adversarial training)."""
    return MLP(lambda m, h: torch.tanh(h)), _batches(3, 8, requires_grad=True)


# ---- parameters and buffers -------------------------------------------------------------------------
@idiom
def tied_parameters():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.mid = nn.Linear(8, 8)
            self.head = nn.Linear(8, 20, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(torch.relu(self.mid(self.emb(ids))))
    return M(), [(torch.randint(0, 20, (2, 5)),) for _ in range(3)]


@idiom
def frozen_base_lora():
    class LoRALinear(nn.Module):
        def __init__(self, d_in, d_out, r=2):
            super().__init__()
            self.base = nn.Linear(d_in, d_out)
            self.base.requires_grad_(False)
            self.A = nn.Parameter(torch.randn(r, d_in) * 0.1)
            self.B = nn.Parameter(torch.randn(d_out, r) * 0.1)

        def forward(self, x):
            return self.base(x) + (x @ self.A.t()) @ self.B.t() * 0.5

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = LoRALinear(8, 16), LoRALinear(16, 4)

        def forward(self, x):
            return self.l2(F.gelu(self.l1(x)))
    return M(), _batches(3, 8)


@idiom
def weight_shared_across_layers():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.out = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            for _ in range(3):
                x = torch.tanh(self.block(x)) + x
            return self.out(x)
    return M(), _batches(3, 8)


@idiom
def batchnorm_running_stats():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.bn, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.bn(self.a(x))))
    return M(), _batches(6, 8)


@idiom
def ema_buffer_updated_in_forward():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
            self.register_buffer("ema", torch.zeros(16))
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            h = self.a(x)
            if self.training:
                with torch.no_grad():
                    self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
                    self.steps += 1
            return self.b(h - self.ema)
    return M(), _batches(3, 8)


@idiom
def spectral_norm_power_iteration():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 16))
            self.b = nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))
    return M(), _batches(3, 8)


@idiom
def weight_norm_parametrization():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.utils.parametrizations.weight_norm(nn.Linear(8, 16))
            self.b = nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))
    return M(), _batches(3, 8)


@idiom
def embedding_padding_idx():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = nn.Embedding(12, 8, padding_idx=0), nn.Linear(8, 3)

        def forward(self, ids):
            return self.out(self.emb(ids).mean(1))
    return M(), [(torch.randint(0, 12, (4, 6)),) for _ in range(3)]


# ---- control flow, graph breaks, checkpoint ------------------------------------------------------
def _item_break(m, h):
    if h.mean().item() > 0:
        return torch.relu(h)
    return torch.tanh(h)


@idiom
def item_graph_break():
    return MLP(_item_break), _batches(3, 8)


def _print_break(m, h):
    m.log.append(float(h.abs().max()))
    return torch.relu(h)


@idiom
def python_side_effect_graph_break():
    return MLP(_print_break), _batches(3, 8)


@idiom
def checkpoint_non_reentrant():
    return MLP(lambda m, h: checkpoint(lambda t: torch.tanh(t) * t, h, use_reentrant=False)), _batches(3, 8)


@idiom
def checkpoint_reentrant():
    return MLP(lambda m, h: checkpoint(lambda t: torch.tanh(t) * t, h, use_reentrant=True)), _batches(3, 8)


@idiom
def checkpoint_with_dropout_inside():
    """The recompute must draw the same dropout mask as the forward (RNG state preserved)."""
    return MLP(lambda m, h: checkpoint(lambda t: F.dropout(torch.tanh(t), 0.3, True) * t, h,
                                       use_reentrant=False)), _batches(3, 8)


@idiom
def checkpoint_with_function_inside():
    return MLP(lambda m, h: checkpoint(lambda t: GradReverse.apply(torch.tanh(t), 0.5) * t, h,
                                       use_reentrant=False)), _batches(3, 8)


def _autograd_grad_in_forward(m, h):
    """A derivative as a feature (physics-informed nets): d(sum tanh(h))/dh inside forward."""
    h = h if h.requires_grad else h.requires_grad_()
    y = torch.tanh(h).sum()
    (dh,) = torch.autograd.grad(y, h, create_graph=True)
    return h + dh


@idiom
def autograd_grad_inside_forward():
    return MLP(_autograd_grad_in_forward), _batches(3, 8)


@idiom
def retain_grad_on_activation():
    def mid(m, h):
        h = torch.tanh(h)
        h.retain_grad()
        m.log.append(h)
        return h
    return MLP(mid), _batches(3, 8)


# ---- outputs -----------------------------------------------------------------------------------------
@idiom
def dict_output():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 2)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return {"logits": self.b(h), "aux": self.c(h), "count": h.shape[0]}
    return M(), _batches(3, 8)


@idiom
def tuple_output_with_non_differentiable():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x):
            logits = self.b(torch.relu(self.a(x)))
            return logits, logits.argmax(-1), [logits.detach() * 2]
    return M(), _batches(3, 8)


@idiom
def dropout_zero_and_eval_submodule():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.drop, self.b = nn.Linear(8, 16), nn.Dropout(0.0), nn.Linear(16, 4)
            self.frozen_drop = nn.Dropout(0.5).eval()

        def forward(self, x):
            return self.b(self.frozen_drop(self.drop(torch.relu(self.a(x)))))
    return M(), _batches(3, 8)
