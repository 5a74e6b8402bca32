"""``opsmath::cross_entropy``: cross-entropy on given logits, without their fp32 copy or log-softmax.

Math, rows n, classes j < V, smoothing e (the same as ``linear_cross_entropy.py``, without the GEMMs)::

    lse_n  = log sum_j exp(z_nj)
    loss_n = (1 - e) (lse_n - z_n,t) + e (lse_n - mean_j z_nj)        0 where t_n == ignore_index
    dz_nj  = g s (exp(z_nj - lse_n) - (1 - e) [j == t_n] - e / V)     s = 1/#valid (mean) or 1 (sum)

with g the incoming gradient of the loss. Shapes: logits (N, V) in any float dtype, target (N,) int64
-> loss () fp32 and lse (N,) fp32 (saved for backward); dz (N, V) in the logits' dtype.

Eager autocast training upcasts the logits to fp32 for ``cross_entropy``, which saves an fp32
log-softmax and later builds an fp32 gradient: three fp32 (N, V) tensors beside the logits. Here the
forward reads the logits once in their own dtype (the row kernel shared with ``linear_cross_entropy``:
online max and sum in fp32) and keeps only lse per row; backward reads them once more and writes the
gradient, already scaled by g, into its one buffer: three passes over N x V in all, and nothing
logits-sized exists between forward and backward but the logits themselves.
"""
from __future__ import annotations

import torch

from opsmath.kernels.ce_rows import grad_scale, reduce, rows
from opsmath.kernels._common import first_order_only
from opsmath.kernels._spec import OpSpec, backward, leaf, register


def _check(logits, target, reduction):
    if reduction not in ("mean", "sum"):
        raise ValueError(f"opsmath::cross_entropy takes reduction 'mean' or 'sum', got {reduction!r}")
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"opsmath::cross_entropy needs logits (N, V) and target (N,), got "
                         f"{tuple(logits.shape)} and {tuple(target.shape)}")


@torch.library.custom_op("opsmath::cross_entropy", mutates_args=())
def cross_entropy_op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                     reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse)."""
    _check(logits, target, reduction)
    valid, scale = grad_scale(target, ignore_index, reduction)
    lse = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    losses = rows(logits.contiguous(), target, ignore_index, label_smoothing, scale, False, lse_out=lse)
    return reduce(losses, valid, reduction), lse


@cross_entropy_op.register_fake
def _(logits, target, ignore_index, label_smoothing, reduction):
    _check(logits, target, reduction)
    return logits.new_empty((), dtype=torch.float32), logits.new_empty(logits.shape[:1], dtype=torch.float32)


@torch.library.custom_op("opsmath::cross_entropy_backward", mutates_args=())
def cross_entropy_backward_op(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor,
                              ignore_index: int, label_smoothing: float, reduction: str) -> torch.Tensor:
    """dlogits = dloss * d(loss)/d(logits), written once, in the logits' dtype."""
    _, scale = grad_scale(target, ignore_index, reduction)
    z = logits.contiguous()
    dz = torch.empty_like(z)
    rows(z, target, ignore_index, label_smoothing, scale * dloss.float(), True, out=dz, lse=lse)
    return dz


@cross_entropy_backward_op.register_fake
def _(logits, target, lse, dloss, ignore_index, label_smoothing, reduction):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, target, ignore_index, label_smoothing, reduction = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.args = (ignore_index, label_smoothing, reduction)


def _backward(ctx, dloss, _dlse):
    first_order_only("cross_entropy")
    logits, target, lse = ctx.saved_tensors
    return cross_entropy_backward_op(logits, target, lse, dloss, *ctx.args), None, None, None, None


cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    """``F.cross_entropy(logits, target, ...)`` for 2-D logits, in their own dtype's memory."""
    return cross_entropy_op(logits, target, ignore_index, float(label_smoothing), reduction)[0]


# --------------------------------------------------------------------------------------------------
# Op spec (src/opsmath/kernels/_spec.py)
# --------------------------------------------------------------------------------------------------


def _exercise(dtype: torch.dtype) -> None:
    t = torch.randint(0, 300, (8,))
    for smoothing in (0.0, 0.1):
        backward(cross_entropy(leaf(8, 300, dtype=dtype), t, -100, smoothing, "mean"))


# the cross-entropy half of linear_cross_entropy is what Inductor fuses better (see there)
SPEC = register(OpSpec("cross_entropy", ops=(torch.ops.opsmath.cross_entropy.default,),
                       inductor_fuses_better=True, exercise=_exercise,
                       saves="the logits and the fp32 per-row log-sum-exp"))
