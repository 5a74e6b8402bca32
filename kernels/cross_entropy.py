"""``opsmath::cross_entropy``: cross-entropy on given logits, without their fp32 copy or log-softmax.

Math, rows n, classes j < V, smoothing e (the same as ``linear_cross_entropy.py``, without the GEMMs)::

    loss_n = (1 - e) (lse_n - z_n,t) + e (lse_n - mean_j z_nj)        0 where t_n == ignore_index
    G_nj   = s (softmax(z_n)_j - (1 - e) [j == t_n] - e / V)           s = 1/#valid (mean) or 1 (sum)

Shapes: logits (N, V) in any float dtype, target (N,) int64 -> loss (), G (N, V) in the logits' dtype.

Eager autocast training upcasts the logits to fp32 for ``cross_entropy``, which saves an fp32
log-softmax and later builds an fp32 gradient: three fp32 (N, V) tensors beside the logits. Here one
row kernel (``linear_cross_entropy.rows``: online max and sum in fp32, then the gradient) reads the
logits in their own dtype and writes G into one buffer of that dtype, in the forward, because the loss
is a scalar at the end of the graph; backward scales G by the incoming gradient. Without
``compute_grad`` (inference graphs) only the loss is computed and nothing is written.
"""
from __future__ import annotations

import torch

from .linear_cross_entropy import grad_scale, reduce, rows


def cross_entropy_forward(logits, target, ignore_index: int, smoothing: float, reduction: str,
                          compute_grad: bool):
    """(loss, G): G is an empty tensor without ``compute_grad``."""
    valid, scale = grad_scale(target, ignore_index, reduction)
    z = logits.contiguous()
    if compute_grad:
        z = z.clone() if z.data_ptr() == logits.data_ptr() else z   # G gets a buffer of its own
    losses = rows(z, target, ignore_index, smoothing, scale, compute_grad)
    return reduce(losses, valid, reduction), (z if compute_grad else logits.new_empty(0))


@torch.library.custom_op("opsmath::cross_entropy", mutates_args=())
def cross_entropy_op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                     reduction: str, compute_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"opsmath::cross_entropy takes reduction 'mean' or 'sum', got {reduction!r}")
    return cross_entropy_forward(logits, target, ignore_index, label_smoothing, reduction, compute_grad)


@cross_entropy_op.register_fake
def _(logits, target, ignore_index, label_smoothing, reduction, compute_grad):
    return logits.new_empty((), dtype=torch.float32), (torch.empty_like(logits, memory_format=torch.contiguous_format)
                                                       if compute_grad else logits.new_empty(0))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.compute_grad = inputs[5]


def _backward(ctx, dloss, _dg):
    if not ctx.compute_grad:
        raise RuntimeError("opsmath::cross_entropy was called with compute_grad=False; it has no gradient to give")
    (g,) = ctx.saved_tensors
    return (g * dloss.to(torch.float32)).to(g.dtype), None, None, None, None, None


cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    """``F.cross_entropy(logits, target, ...)`` for 2-D logits, in their own dtype's memory."""
    need = torch.is_grad_enabled() and logits.requires_grad
    return cross_entropy_op(logits, target, ignore_index, label_smoothing, reduction, need)[0]
