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

The row pass (``rows``): per-row cross entropy over a chunk of logits, the loss, each row's log-sum-exp
and the gradient G, shared with ``opsmath::linear_cross_entropy`` (its chunks).

For rows n of logits z (rows, V), target t, smoothing e, scale s (1/#valid for a mean, else 1), softcap c
(y = c tanh(z / c) read for z where c > 0)::

    lse_n  = log sum_j exp(z_nj)
    loss_n = (1 - e) (lse_n - z_n,t) + e (lse_n - mean_j z_nj)        0 where t_n == ignore_index
    G_nj   = s (softmax(z_n)_j - (1 - e) [j == t_n] - e / V)           (times 1 - (y / c)^2 under a softcap)

Triton on CUDA (one program per row, two passes over the row), the PyTorch reference on CPU: the same
function, which the kernel tests compare.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opsmath.kernels._common import first_order_only, next_pow2, use_triton
from opsmath.kernels._spec import OpSpec, backward, leaf, register


def _rows_reference(z: torch.Tensor, t: torch.Tensor, ignore_index: int, smoothing: float,
                    scale: torch.Tensor, compute_grad: bool, out=None, lse_out=None, lse=None,
                    softcap: float = 0.0) -> torch.Tensor:
    """Loss per row (fp32) of the logits chunk ``z`` (rows, V); writes G into ``out`` (default: over
    ``z``) when asked; ``lse_out`` receives each row's log-sum-exp; a given ``lse`` skips computing it."""
    zf = z.float()
    if softcap:
        zf = softcap * torch.tanh(zf / softcap)
    V = z.shape[1]
    valid = t != ignore_index
    tt = torch.where(valid, t, 0)
    if lse is None:
        lse = torch.logsumexp(zf, 1)
        if lse_out is not None:
            lse_out.copy_(lse)
    zt = zf.gather(1, tt[:, None])[:, 0]
    loss = (1 - smoothing) * (lse - zt)
    if smoothing:   # only then: a -inf logit (a vocabulary mask) would make 0 * inf = nan
        loss = loss + smoothing * (lse - zf.mean(1))
    loss = torch.where(valid, loss, 0.0)
    if compute_grad:
        g = torch.exp(zf - lse[:, None])
        g.scatter_add_(1, tt[:, None], torch.full_like(zt[:, None], -(1 - smoothing)))
        g = (g - smoothing / V) * torch.where(valid, scale, 0.0)[:, None]
        if softcap:
            g = g * (1 - (zf / softcap) ** 2)
        (z if out is None else out).copy_(g)
    return loss


@triton.jit
def _softcap(z, c):
    """c tanh(z / c), as 2 sigmoid(2 z / c) - 1 (Triton has no portable tanh)."""
    return c * (2.0 * tl.sigmoid(z * (2.0 / c)) - 1.0)


@triton.jit
def _ce_rows_kernel(Z, T, Loss, Scale, G, Lse, stride_z, stride_g, V, ignore_index, smoothing, softcap,
                    COMPUTE_GRAD: tl.constexpr, WRITE_LSE: tl.constexpr, LSE_GIVEN: tl.constexpr,
                    HAS_SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row. A target outside [0, V) that is not ``ignore_index`` gives a NaN loss and a
    NaN gradient row (eager raises; checking on the host would cost a sync every step)."""
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    t = tl.load(T + row)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    if LSE_GIVEN:      # gradient only, from the forward's log-sum-exp: one read of z, one write of G
        lse = tl.load(Lse + row)
    else:
        # online max and sum with one running (max, sum) per row, rescaled once per block: one exp per
        # logit (a running pair per lane would need two). z_t is one load after the loop, and the sum
        # of z only with smoothing: no per-lane accumulators beside the logits block (registers decide
        # how many rows an SM holds at once)
        m = -1e30          # finite: a block of -inf logits never makes exp(-inf + inf)
        s = 0.0
        if HAS_SMOOTHING:
            zsum = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inb = cols < V
            z = tl.load(z_row + cols, mask=inb, other=float("-inf")).to(tl.float32)
            if SOFTCAP:   # c tanh(z / c); lanes past V stay -inf
                z = tl.where(inb, _softcap(z, softcap), float("-inf"))
            m_new = tl.maximum(m, tl.max(z, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)   # lanes past V: exp(-inf) = 0
            m = m_new
            if HAS_SMOOTHING:
                zsum += tl.where(inb, z, 0.0)
        lse = m + tl.log(s)
        zt = tl.load(z_row + t, mask=valid & in_range, other=0.0).to(tl.float32)
        if SOFTCAP:
            zt = _softcap(zt, softcap)
        loss = (1 - smoothing) * (lse - zt)
        if HAS_SMOOTHING:   # only then: with a -inf logit (a vocabulary mask) the mean is -inf
            loss += smoothing * (lse - tl.sum(zsum, 0) / V)
        loss = tl.where(in_range, loss, float("nan"))
        tl.store(Loss + row, tl.where(valid, loss, 0.0))
        if WRITE_LSE:
            tl.store(Lse + row, lse)
    if COMPUTE_GRAD:
        scale = tl.where(valid, tl.where(in_range, tl.load(Scale), float("nan")), 0.0)
        g_row = G + row * stride_g
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inb = cols < V
            z = tl.load(z_row + cols, mask=inb, other=0.0).to(tl.float32)
            if SOFTCAP:
                z = _softcap(z, softcap)
            g = tl.exp(z - lse) - tl.where(cols == t, 1 - smoothing, 0.0) - smoothing / V
            if SOFTCAP:   # d(c tanh(z / c)) / dz = 1 - tanh^2
                g = g * (1 - (z / softcap) * (z / softcap))
            tl.store(g_row + cols, (g * scale).to(G.dtype.element_ty), mask=inb)


def grad_scale(target: torch.Tensor, ignore_index: int, reduction: str):
    """(#valid rows, the gradient's scale s as a 1-element fp32 tensor: 1/#valid for mean, 1 for sum);
    kept on the device, so no host sync."""
    valid = (target != ignore_index).sum()
    scale = (1.0 / valid.float()) if reduction == "mean" else torch.ones((), device=target.device)
    return valid, scale.reshape(1).to(torch.float32)


def reduce(losses: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-row losses to the loss: their sum, divided by #valid for mean (0/0 = nan, as torch)."""
    loss = losses.sum()
    return loss / valid if reduction == "mean" else loss


def rows(z, t, ignore_index, smoothing, scale, compute_grad, out=None, lse_out=None, lse=None, softcap=0.0):
    """Per-row loss of the logits rows ``z`` (rows, V), contiguous along V. With ``compute_grad`` G
    (module doc) is written into ``out``, by default over ``z`` itself. ``lse_out`` (rows,) fp32 receives
    each row's log-sum-exp; a given ``lse`` makes it a gradient-only pass (the returned losses are then
    not computed). ``softcap`` c > 0 reads c tanh(z / c) for z (module doc). Triton on CUDA, the PyTorch
    reference on CPU."""
    if not use_triton(z):
        return _rows_reference(z, t, ignore_index, smoothing, scale, compute_grad, out, lse_out, lse, softcap)
    loss = torch.empty(z.shape[0], device=z.device, dtype=torch.float32)
    g = z if out is None else out
    lse_buf = lse if lse is not None else lse_out
    block = min(4096, next_pow2(z.shape[1]))
    _ce_rows_kernel[(z.shape[0],)](z, t, loss, scale, g, lse_buf if lse_buf is not None else loss,
                                   z.stride(0), g.stride(0), z.shape[1], ignore_index, float(smoothing),
                                   float(softcap or 1.0), COMPUTE_GRAD=compute_grad,
                                   WRITE_LSE=lse_out is not None and lse is None, LSE_GIVEN=lse is not None,
                                   HAS_SMOOTHING=smoothing > 0, SOFTCAP=softcap > 0, BLOCK=block,
                                   num_warps=8 if block >= 2048 else 4)
    return loss


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
