"""``opsmath::scaled_softmax``: ``softmax(scale * x + bias)`` over the last dim, forward and backward, for the
softmaxes outside attention (routers, attention probabilities that are returned, temperature-scaled
distributions).

Math, per row of width N, z = scale * x + bias (bias additive, may hold -inf: a mask)::

    y  = exp(z - max z) / sum exp(z - max z)
    dz = y * (dy - sum(dy * y))
    dx = scale * dz,   dbias = dz summed over the dims bias broadcasts along

Shapes: x (..., N) with up to 4 dims; bias None or broadcastable to x (e.g. (B, 1, 1, N) padding, (1, 1,
S, N) causal); y in x's dtype, fp32 math. A row whose entries are all -inf gives NaN, as eager does.

Eager writes scale * x and then + bias before the softmax reads them back (three passes and two
temporaries forward, two passes backward plus the scale's); here forward reads x (and the bias through
its broadcast strides, never expanded) and writes y, and backward reads y and dy and writes dx. A row
of up to 8192 is read once and kept in registers; wider rows are processed in chunks with an online
max and sum (and read twice).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from opsmath.kernels._common import first_order_only, next_pow2, use_triton
from opsmath.kernels._spec import OpSpec, backward, leaf, register

_MAX_BLOCK = 8192   # widest row kept in registers (16 fp32 per thread at 16 warps)


@triton.jit
def _bias_ptrs(b_ptr, row, D1, D2, s0, s1, s2, s3, cols):
    i2 = row % D2
    i1 = (row // D2) % D1
    i0 = row // (D2 * D1)
    return b_ptr + i0 * s0 + i1 * s1 + i2 * s2 + cols * s3


@triton.jit
def _scores_block(x_ptr, b_ptr, row, cols, N, D1, D2, s0, s1, s2, s3, scale, HAS_BIAS: tl.constexpr):
    """scale * x + bias for the columns ``cols`` of one row, fp32, -inf past the row's end."""
    m = cols < N
    z = tl.load(x_ptr + row * N + cols, mask=m, other=float("-inf")).to(tl.float32) * scale
    if HAS_BIAS:
        z += tl.load(_bias_ptrs(b_ptr, row, D1, D2, s0, s1, s2, s3, cols), mask=m, other=0.0).to(tl.float32)
    return z


@triton.jit
def _softmax_fwd(x_ptr, b_ptr, y_ptr, N, D1, D2, s0, s1, s2, s3, scale, HAS_BIAS: tl.constexpr,
                 ONE_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if ONE_BLOCK:      # the row fits one block: read once, keep it in registers
        cols = tl.arange(0, BLOCK)
        z = _scores_block(x_ptr, b_ptr, row, cols, N, D1, D2, s0, s1, s2, s3, scale, HAS_BIAS)
        mx = tl.max(z, 0)
        e = tl.exp(z - mx)
        tl.store(y_ptr + row * N + cols, (e / tl.sum(e, 0)).to(y_ptr.dtype.element_ty), mask=cols < N)
    else:
        m_i = tl.full((BLOCK,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, N, BLOCK):   # online max and sum, per lane
            cols = start + tl.arange(0, BLOCK)
            z = _scores_block(x_ptr, b_ptr, row, cols, N, D1, D2, s0, s1, s2, s3, scale, HAS_BIAS)
            m_new = tl.maximum(m_i, z)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.exp(z - m_safe)
            m_i = m_new
        mx = tl.max(m_i, 0)
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        total = tl.sum(l_i * tl.exp(m_i - mx_safe), 0)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = _scores_block(x_ptr, b_ptr, row, cols, N, D1, D2, s0, s1, s2, s3, scale, HAS_BIAS)
            tl.store(y_ptr + row * N + cols, (tl.exp(z - mx) / total).to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _softmax_bwd(y_ptr, dy_ptr, dx_ptr, N, scale, ONE_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK)
        m = cols < N
        y = tl.load(y_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * N + cols, (scale * y * (dy - tl.sum(y * dy, 0))).to(dx_ptr.dtype.element_ty),
                 mask=m)
    else:
        acc = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < N
            y = tl.load(y_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
            acc += y * dy
        s = tl.sum(acc, 0)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < N
            y = tl.load(y_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row * N + cols, (scale * y * (dy - s)).to(dx_ptr.dtype.element_ty), mask=m)


def _block(N: int) -> int:
    return max(16, min(_MAX_BLOCK, next_pow2(N)))


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def softmax_forward_triton(x, bias, scale):
    N = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // N if N else 0
    if not rows:
        return y
    lead = (1,) * (4 - x.dim()) + tuple(x.shape[:-1])       # (D0, D1, D2) of the leading dims
    if bias is not None:
        b = bias.reshape((1,) * (x.dim() - bias.dim()) + tuple(bias.shape)).expand(x.shape)
        b = b.reshape((1,) * (4 - x.dim()) + tuple(b.shape)) if x.dim() < 4 else b
        strides = list(b.stride())
    else:
        b, strides = x, [0, 0, 0, 0]
    block = _block(N)
    _softmax_fwd[(rows,)](x, b, y, N, lead[-2], lead[-1], *strides, float(scale), HAS_BIAS=bias is not None,
                          ONE_BLOCK=N <= block, BLOCK=block, num_warps=_warps(block))
    return y


def softmax_backward_triton(y, dy, scale):
    N = y.shape[-1]
    dy = dy.contiguous()
    dx = torch.empty_like(y)
    rows = y.numel() // N if N else 0
    if rows:
        block = _block(N)
        _softmax_bwd[(rows,)](y, dy, dx, N, float(scale), ONE_BLOCK=N <= block, BLOCK=block,
                              num_warps=_warps(block))
    return dx


def softmax_reference(x, bias, scale):
    ct = torch.promote_types(x.dtype, torch.float32)
    z = x.to(ct) * scale
    if bias is not None:
        z = z + bias.to(ct)
    return torch.softmax(z, -1).to(x.dtype)


def softmax_backward_reference(y, dy, scale):
    ct = torch.promote_types(y.dtype, torch.float32)
    yf, dyf = y.to(ct), dy.to(ct)
    return (scale * yf * (dyf - (yf * dyf).sum(-1, keepdim=True))).to(y.dtype)


def _check(x, bias):
    if x.dim() == 0 or x.dim() > 4:
        raise ValueError(f"opsmath::scaled_softmax takes 1 to 4 dims, got {x.dim()}")
    if bias is not None:
        try:
            torch.broadcast_shapes(bias.shape, x.shape)
        except RuntimeError:
            raise ValueError(f"opsmath::scaled_softmax: bias {tuple(bias.shape)} does not broadcast to "
                             f"{tuple(x.shape)}") from None
        if torch.broadcast_shapes(bias.shape, x.shape) != x.shape:
            raise ValueError(f"opsmath::scaled_softmax: bias {tuple(bias.shape)} would enlarge {tuple(x.shape)}")


@torch.library.custom_op("opsmath::scaled_softmax", mutates_args=())
def scaled_softmax_op(x: torch.Tensor, bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    _check(x, bias)
    if use_triton(x):
        return softmax_forward_triton(x, bias, scale)
    return softmax_reference(x, bias, scale).contiguous()


@scaled_softmax_op.register_fake
def _(x, bias, scale):
    _check(x, bias)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("opsmath::scaled_softmax_backward", mutates_args=())
def scaled_softmax_backward_op(y: torch.Tensor, dy: torch.Tensor, scale: float) -> torch.Tensor:
    if use_triton(y):
        return softmax_backward_triton(y, dy, scale)
    return softmax_backward_reference(y, dy, scale).contiguous()


@scaled_softmax_backward_op.register_fake
def _(y, dy, scale):
    return torch.empty(y.shape, dtype=y.dtype, device=y.device)


def _setup_context(ctx, inputs, output):
    x, bias, scale = inputs
    ctx.save_for_backward(output)
    ctx.scale = scale
    ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)


def _backward(ctx, dy):
    first_order_only("scaled_softmax")
    (y,) = ctx.saved_tensors
    dx = scaled_softmax_backward_op(y, dy, ctx.scale)
    dbias = None
    if ctx.bias_meta is not None and ctx.needs_input_grad[1]:
        shape, dt = ctx.bias_meta
        dz = dx.float() / ctx.scale if ctx.scale != 0 else softmax_backward_reference(y, dy, 1.0).float()
        dbias = dz.sum_to_size(shape).to(dt)
    return dx, dbias, None


scaled_softmax_op.register_autograd(_backward, setup_context=_setup_context)
# CUDA autocast runs softmax in fp32 (its output is fp32 under autocast); the fused op does the same, so a
# rewrite never changes a dtype downstream. CPU autocast keeps softmax in the input dtype: nothing to do.
torch.library.register_autocast("opsmath::scaled_softmax", "cuda", torch.float32)


def scaled_softmax(x: torch.Tensor, bias: Optional[torch.Tensor] = None, scale: float = 1.0) -> torch.Tensor:
    """``torch.softmax(scale * x + bias, -1)``; see the module docstring."""
    return scaled_softmax_op(x, bias, float(scale))


# --------------------------------------------------------------------------------------------------
# Op spec (src/opsmath/kernels/_spec.py)
# --------------------------------------------------------------------------------------------------


def _exercise(dtype: torch.dtype) -> None:
    for width, bias in ((40, True), (40, False), (9000, True)):
        backward(scaled_softmax(leaf(2, width, dtype=dtype), leaf(width, dtype=dtype) if bias else None, 0.5))


# a row reduction Inductor fuses with its neighbours
SPEC = register(OpSpec("scaled_softmax", ops=(torch.ops.opsmath.scaled_softmax.default,),
                       inductor_fuses_better=True, exercise=_exercise,
                       saves="its output"))
