"""Random module stacks for the semantics suite: linears, norms, activations, attention spellings,
residuals, custom Functions and hooks, drawn from a seed."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from idioms_autograd import GradReverse, Square3


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
