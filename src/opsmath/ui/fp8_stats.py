"""FP8 numerics of a model optimized with ``fp8=True``: per FP8 linear, the share of nonzero values that
tensorwise scaling flushes to zero (``kernels.fp8_linear.underflow``), for

- its weight (e4m3), from the live parameter;
- given a batch, its input activation (e4m3) and the gradient of its output (e5m2), measured on one eager
  forward and backward of that batch through the model's own modules.

The measuring step leaves the model as it was: the compiled path is bypassed for it, gradients are taken
with ``torch.autograd.grad`` (no ``.grad`` is touched), and the RNG states and buffers (running
statistics) are restored afterwards. Nothing overflows: dynamic scaling maps each tensor's amax to the
format's largest value. A weight read through ``F.linear`` in another module's code (a tied LM head) has
no module to observe: its activation and gradient are ``None``.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn as nn

from opsmath.kernels.fp8_linear import E4M3, E5M2, underflow


def fp8_rows(model: nn.Module, weights: list[str], batch=None, loss_fn: Optional[Callable] = None) -> list[dict]:
    """One row per weight name: ``weight``, ``underflow`` and, with a ``batch`` (a dict of keyword
    arguments or a tuple of positional ones), ``activation`` and ``gradient`` (the largest share over
    the module's calls; ``gradient`` needs a loss: ``loss_fn(output)``, else the output's ``.loss``, else
    a scalar output)."""
    rows = {}
    for name in weights:
        try:
            rows[name] = dict(weight=name, underflow=underflow(model.get_parameter(name).detach()))
        except AttributeError:
            continue
    if batch is not None:
        for name, seen in _observe(model, list(rows), batch, loss_fn).items():
            rows[name].update(seen)
    return list(rows.values())


def _linear_of(model: nn.Module, weight: str) -> Optional[nn.Linear]:
    owner, _, leaf = weight.rpartition(".")
    try:
        mod = model.get_submodule(owner)
    except AttributeError:
        return None
    return mod if isinstance(mod, nn.Linear) and leaf == "weight" else None


def _observe(model: nn.Module, weights: list[str], batch, loss_fn) -> dict[str, dict]:
    """Activation and output-gradient underflow per weight, from one eager step that changes nothing."""
    seen = {w: dict(activation=None, gradient=None) for w in weights}

    def worst(name, key, t, dtype):
        share = underflow(t.detach(), dtype)
        seen[name][key] = share if seen[name][key] is None else max(seen[name][key], share)

    hooks = []
    for w in weights:
        mod = _linear_of(model, w)
        if mod is not None:
            hooks.append(mod.register_forward_hook(lambda m, a, out, w=w: worst(w, "activation", a[0], E4M3)))
            hooks.append(mod.register_full_backward_hook(lambda m, gi, go, w=w: worst(w, "gradient", go[0], E5M2)))
    try:
        with _unchanged(model):
            out = model(**batch) if isinstance(batch, dict) else model(*batch)
            loss = loss_fn(out) if loss_fn else getattr(out, "loss", None)
            if loss is None and torch.is_tensor(out) and out.numel() == 1:
                loss = out
            params = [p for p in model.parameters() if p.requires_grad]
            if loss is not None and params:
                torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    return seen


@contextlib.contextmanager
def _unchanged(model: nn.Module):
    """Run ``model`` eagerly (its compiled call bypassed) and restore its buffers and the RNG states."""
    compiled, model._compiled_call_impl = getattr(model, "_compiled_call_impl", None), None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        model._compiled_call_impl = compiled
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
