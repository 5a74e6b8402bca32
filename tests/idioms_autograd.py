"""Idioms with their own autograd semantics: custom ``autograd.Function``s and hooks."""
from __future__ import annotations

import torch
import torch.nn as nn

from idioms_base import MLP, _batches, idiom


# ---- custom autograd Functions -----------------------------------------------------------------
class Square3(torch.autograd.Function):
    """Forward x², backward 3·x·g (deliberately not the derivative: a custom backward must be kept)."""
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * g * x


class GradReverse(torch.autograd.Function):
    """Domain-adversarial gradient reversal: identity forward, -lambda·g backward."""
    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


class MaxWithIndex(torch.autograd.Function):
    """Two outputs, the index one marked non-differentiable."""
    @staticmethod
    def forward(ctx, x):
        v, i = x.max(dim=-1)
        ctx.save_for_backward(i)
        ctx.shape = x.shape
        ctx.mark_non_differentiable(i)
        return v, i

    @staticmethod
    def backward(ctx, gv, gi):
        (i,) = ctx.saved_tensors
        return torch.zeros(ctx.shape, dtype=gv.dtype, device=gv.device).scatter(-1, i.unsqueeze(-1), gv.unsqueeze(-1)) * 2


class ScaleInplace(torch.autograd.Function):
    """In-place forward (``mark_dirty``)."""
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2.0)

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


class OnceDiff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sigmoid(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * s * (1 - s) * 1.5


class WeightedMul(torch.autograd.Function):
    """Two differentiable inputs (an activation and a parameter), ``needs_input_grad`` honored."""
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g * w if ctx.needs_input_grad[0] else None
        gw = (g * x).sum(0) * 0.1 if ctx.needs_input_grad[1] else None
        return gx, gw


class StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


@idiom
def function_custom_backward():
    return MLP(lambda m, h: Square3.apply(h)), _batches(3, 8)


@idiom
def function_gradient_reversal():
    return MLP(lambda m, h: GradReverse.apply(h, 0.3)), _batches(3, 8)


@idiom
def function_non_differentiable_output():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(1, 4)

        def forward(self, x):
            v, i = MaxWithIndex.apply(self.a(x))
            return self.b(v.unsqueeze(-1) + i.unsqueeze(-1).to(v.dtype) * 0.01)
    return M(), _batches(3, 8)


@idiom
def function_mark_dirty():
    return MLP(lambda m, h: ScaleInplace.apply(h * 1.0)), _batches(3, 8)


@idiom
def function_once_differentiable():
    return MLP(lambda m, h: OnceDiff.apply(h)), _batches(3, 8)


@idiom
def function_parameter_input():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.w = nn.Linear(8, 16), nn.Linear(16, 4), nn.Parameter(torch.randn(16))

        def forward(self, x):
            return self.b(WeightedMul.apply(self.a(x), self.w))
    return M(), _batches(3, 8)


@idiom
def function_straight_through():
    return MLP(lambda m, h: StraightThrough.apply(torch.tanh(h))), _batches(3, 8)


# ---- hooks ---------------------------------------------------------------------------------------
def _scale_hook(m, h):
    h = torch.tanh(h)
    h.register_hook(lambda g: g * 0.5)
    return h


@idiom
def tensor_hook_scales_grad():
    return MLP(_scale_hook), _batches(3, 8)


def _logging_hook(m, h):
    h = torch.relu(h)
    h.register_hook(lambda g: m.log.append(g.detach().clone()))
    return h * 2


@idiom
def tensor_hook_observes_grad():
    return MLP(_logging_hook), _batches(3, 8)


@idiom
def module_forward_hook():
    m = MLP(lambda m, h: torch.relu(h))
    m.a.register_forward_hook(lambda mod, args, out: out * 0.5 + 1)
    return m, _batches(3, 8)


@idiom
def module_forward_pre_hook():
    m = MLP(lambda m, h: torch.relu(h))
    m.b.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    return m, _batches(3, 8)


@idiom
def module_full_backward_hook():
    m = MLP(lambda m, h: torch.relu(h))
    m.b.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 0.25,))
    return m, _batches(3, 8)


@idiom
def parameter_hook_registered_outside():
    m = MLP(lambda m, h: torch.relu(h))
    m.a.weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
    return m, _batches(3, 8)


@idiom
def post_accumulate_grad_hook():
    """A hook after a parameter's gradient is accumulated (optimizer-in-backward, gradient logging)."""
    m = MLP(lambda m, h: torch.relu(h))
    m.a.weight.register_post_accumulate_grad_hook(lambda p: m.log.append(p.grad.norm().detach().clone()))
    return m, _batches(3, 8)
