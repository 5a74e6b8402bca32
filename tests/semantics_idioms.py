"""Training idioms for the differential semantics suite (``test_semantics.py``).

Each idiom is a function returning ``(model, batches)``: a small fp32 module that uses one construct
whose autograd or state semantics a graph capture can get wrong, and a list of input tuples, one per
training step. The model's output is reduced to a loss by ``reduce_output`` (a scalar, a tuple, a
dict or a Hugging Face ``ModelOutput``). Side effects the model records (a hook's log) live in
``model.log``, a list the suite compares too.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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



# ---- random module stacks ------------------------------------------------------------------------
class Residual(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return x + self.f(x)


class Attention(nn.Module):
    """Causal self-attention in one of three spellings: hand-written softmax, SDPA, or einsum."""

    def __init__(self, d, heads, spelling):
        super().__init__()
        self.qkv, self.proj, self.h, self.spelling = nn.Linear(d, 3 * d), nn.Linear(d, d), heads, spelling

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        if self.spelling == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-2, -1) if self.spelling == "matmul" else torch.einsum("bhqd,bhkd->bhqk", q, k))
            s = s / (D // self.h) ** 0.5
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            y = torch.softmax(s, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class SwiGLU(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False), \
            nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _hooked(x):
    x = x * 1.0
    if x.requires_grad:
        x.register_hook(lambda g: g * 0.7)
    return x


_LAYERS = {
    "linear": lambda d, r: nn.Linear(d, d),
    "layernorm": lambda d, r: nn.LayerNorm(d),
    "rmsnorm": lambda d, r: nn.RMSNorm(d),
    "gelu": lambda d, r: nn.GELU(approximate=r.choice(["none", "tanh"])),
    "silu": lambda d, r: nn.SiLU(),
    "tanh": lambda d, r: nn.Tanh(),
    "dropout0": lambda d, r: nn.Dropout(0.0),
    "mlp": lambda d, r: Residual(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))),
    "swiglu": lambda d, r: Residual(SwiGLU(d)),
    "attention": lambda d, r: Residual(Attention(d, 2, r.choice(["matmul", "sdpa", "einsum"]))),
    "function": lambda d, r: Lambda(lambda x: Square3.apply(x * 0.5)),
    "grad_reverse": lambda d, r: Lambda(lambda x: GradReverse.apply(x, 0.5)),
    "hook": lambda d, r: Lambda(_hooked),
}


def random_stack(seed: int, d: int = 16):
    """A random stack of 3-7 layers drawn from ``_LAYERS`` (seeded), on (2, 8, d) inputs."""
    import random
    r = random.Random(seed)
    names = [r.choice(sorted(_LAYERS)) for _ in range(r.randint(3, 7))]
    model = nn.Sequential(*[_LAYERS[n](d, r) for n in names], nn.Linear(d, 5))
    return model, [(torch.randn(2, 8, d),) for _ in range(3)], names
