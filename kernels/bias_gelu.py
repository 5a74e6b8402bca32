"""``opsmath::bias_gelu``: ``dropout(gelu(x + bias))`` in the erf or tanh form, forward and backward.

Math, with z = x + bias (fp32 math, y stored in x's dtype), k = sqrt(2/pi), c = 0.044715::

    erf:   y = z/2 (1 + erf(z / sqrt 2))           y' = (1 + erf(z / sqrt 2))/2 + z exp(-z^2/2) / sqrt(2 pi)
    tanh:  t = tanh(k (z + c z^3)),  y = z/2 (1 + t)   y' = (1 + t)/2 + z/2 (1 - t^2) k (1 + 3 c z^2)
    out = y * keep / (1 - p)       keep = hash(seed, flat index) >= p  (``_common.keep_mask``; p = 0: out = y)
    dx = dout * keep / (1 - p) * y',   dbias = sum over rows of dx

Shapes: x (..., N), bias (N,) -> out (..., N) in x's dtype; dbias in bias's dtype.

The pattern (``patterns/bias_gelu.py``) takes the bias out of ``linear(x, W, b) -> gelu``: the GEMM runs
without it and this op adds it on the way into the GELU. Forward moves what the GELU alone moved (read
x, write y); backward computes dx and the bias gradient in one pass over dy and x instead of writing dx
and reading it again for the bias sum. Both kernels work on (TILE_M, BLOCK_N) tiles of about 4096 elements.
dbias is reduced without atomics: each backward program sums a block of ``_ROWS`` rows into an fp32
partial row, and a small torch sum adds the partials. With dropout (timm's
``Mlp``: fc1 -> act -> drop) no mask is stored: backward regenerates it from the seed, so what is saved
is x and the seed, against eager's pre-activation, GELU output and boolean mask.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import dropout_keep, flat_offsets, keep_mask, row_tile, use_triton

_ROWS = 16   # rows per backward program: its dbias partial is 1/_ROWS of a row tensor, in fp32
_SQRT1_2 = 1 / math.sqrt(2.0)
_K = math.sqrt(2.0 / math.pi)


@triton.jit
def _gelu_and_grad(z, TANH: tl.constexpr):
    """(gelu(z), gelu'(z)) in fp32."""
    if TANH:
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        y = 0.5 * z * (1.0 + t)
        dy = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
    else:
        e = tl.math.erf(z * 0.7071067811865476)
        y = 0.5 * z * (1.0 + e)
        dy = 0.5 * (1.0 + e) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    return y, dy


@triton.jit
def _dropout_scale(seed, offs, p, HAS_DROPOUT: tl.constexpr):
    """keep / (1 - p) for int64 flat offsets (1.0 without dropout)."""
    if HAS_DROPOUT:
        scale = tl.where(keep_mask(seed, offs, p), 1.0 / (1.0 - p), 0.0)
    else:  # one return of one type: compiled Triton rejects a block on one path and a scalar on the other
        scale = tl.full(offs.shape, 1.0, tl.float32)
    return scale


@triton.jit
def _bias_gelu_fwd(x_ptr, b_ptr, y_ptr, M, N, seed, p, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   TANH: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """One (TILE_M, BLOCK_N) tile per program, loaded at once: enough bytes in flight per SM to keep
    HBM busy (one row at a time was not)."""
    rows = (tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    z = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32) + bias[None, :]
    y, _ = _gelu_and_grad(z, TANH)
    y = y * _dropout_scale(seed, offs, p, HAS_DROPOUT)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bias_gelu_bwd(dy_ptr, x_ptr, b_ptr, dx_ptr, dbp_ptr, M, N, seed, p, ROWS: tl.constexpr,
                   TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, TANH: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """ROWS rows per program in (TILE_M, BLOCK_N) tiles; the program's fp32 partial of dbias (its rows
    summed) goes to row ``program_id(0)`` of ``dbp``."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < N
    bias = tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(ROWS // TILE_M):
        rows = (tl.program_id(0) * ROWS + i * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
        m = (rows[:, None] < M) & cm[None, :]
        offs = rows[:, None] * N + cols[None, :]
        z = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32) + bias[None, :]
        g = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        _, d = _gelu_and_grad(z, TANH)
        dx = tl.where(m, g * d * _dropout_scale(seed, offs, p, HAS_DROPOUT), 0.0)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)
        acc += tl.sum(dx, 0)
    tl.store(dbp_ptr + tl.program_id(0).to(tl.int64) * N + cols, acc, mask=cm)


def _launch(x, N):
    """(M, BLOCK_N, TILE_M, ROWS per backward program); tiles of ``ROW_TILE`` elements run at 8 warps
    (16 per thread per tensor)."""
    M = x.numel() // N if N else 0
    tile_m, block_n = row_tile(N, max_block_n=1024)
    return M, block_n, tile_m, max(_ROWS, tile_m)


def bias_gelu_forward_triton(x, bias, approximate, dropout_p=0.0, seed=0):
    N = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    M, block_n, tile_m, _ = _launch(x, N)
    if M:
        grid = (triton.cdiv(M, tile_m), triton.cdiv(N, block_n))
        _bias_gelu_fwd[grid](x, bias.contiguous(), y, M, N, int(seed), float(dropout_p), TILE_M=tile_m,
                             BLOCK_N=block_n, TANH=approximate == "tanh", HAS_DROPOUT=dropout_p > 0, num_warps=8)
    return y


def bias_gelu_backward_triton(dy, x, bias, approximate, dropout_p=0.0, seed=0):
    N = x.shape[-1]
    x, dy = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(x)
    M, block_n, tile_m, rows = _launch(x, N)
    grid = (triton.cdiv(M, rows), triton.cdiv(N, block_n))
    dbp = torch.empty((max(grid[0], 1), N), device=x.device, dtype=torch.float32)
    if M:
        _bias_gelu_bwd[grid](dy, x, bias.contiguous(), dx, dbp, M, N, int(seed), float(dropout_p), ROWS=rows,
                             TILE_M=tile_m, BLOCK_N=block_n, TANH=approximate == "tanh",
                             HAS_DROPOUT=dropout_p > 0, num_warps=8)
    else:
        dbp.zero_()
    return dx, dbp.sum(0).to(bias.dtype)


def _dropout_ref(x, dropout_p, seed, ct):
    """keep / (1 - p) as a tensor of x's shape in dtype ct (1 without dropout)."""
    if dropout_p <= 0:
        return torch.ones((), dtype=ct, device=x.device)
    keep = dropout_keep(int(seed), flat_offsets(x.shape, x.device), dropout_p)
    return keep.to(ct) / (1 - dropout_p)


def bias_gelu_reference(x, bias, approximate, dropout_p=0.0, seed=0):
    ct = torch.promote_types(x.dtype, torch.float32)
    y = torch.nn.functional.gelu(x.to(ct) + bias.to(ct), approximate=approximate)
    return (y * _dropout_ref(x, dropout_p, seed, ct)).to(x.dtype)


def bias_gelu_backward_reference(dy, x, bias, approximate, dropout_p=0.0, seed=0):
    ct = torch.promote_types(x.dtype, torch.float32)
    z = x.to(ct) + bias.to(ct)
    if approximate == "tanh":
        t = torch.tanh(_K * (z + 0.044715 * z**3))
        d = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _K * (1 + 3 * 0.044715 * z * z)
    else:
        d = 0.5 * (1 + torch.erf(z * _SQRT1_2)) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    dx = dy.to(ct) * d * _dropout_ref(x, dropout_p, seed, ct)
    return dx.to(x.dtype), dx.reshape(-1, x.shape[-1]).sum(0).to(bias.dtype)


def _check(x, bias, approximate, dropout_p):
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"opsmath::bias_gelu takes dropout_p in [0, 1), got {dropout_p}")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"opsmath::bias_gelu takes approximate 'none' or 'tanh', got {approximate!r}")
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"opsmath::bias_gelu needs a bias of shape ({x.shape[-1]},), got {tuple(bias.shape)}")


@torch.library.custom_op("opsmath::bias_gelu", mutates_args=())
def bias_gelu_op(x: torch.Tensor, bias: torch.Tensor, approximate: str, dropout_p: float,
                 seed: torch.Tensor) -> torch.Tensor:
    _check(x, bias, approximate, dropout_p)
    if use_triton(x):
        return bias_gelu_forward_triton(x, bias, approximate, dropout_p, int(seed))
    return bias_gelu_reference(x, bias, approximate, dropout_p, int(seed)).contiguous()


@bias_gelu_op.register_fake
def _(x, bias, approximate, dropout_p, seed):
    _check(x, bias, approximate, dropout_p)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("opsmath::bias_gelu_backward", mutates_args=())
def bias_gelu_backward_op(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str,
                          dropout_p: float, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    impl = bias_gelu_backward_triton if use_triton(x) else bias_gelu_backward_reference
    dx, db = impl(dy, x, bias, approximate, dropout_p, int(seed))
    return dx.contiguous(), db.contiguous()


@bias_gelu_backward_op.register_fake
def _(dy, x, bias, approximate, dropout_p, seed):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(bias)


def _setup_context(ctx, inputs, output):
    x, bias, approximate, dropout_p, seed = inputs
    ctx.save_for_backward(x, bias, seed)
    ctx.args = (approximate, dropout_p)


def _backward(ctx, dy):
    x, bias, seed = ctx.saved_tensors
    dx, db = bias_gelu_backward_op(dy, x, bias, *ctx.args, seed)
    return dx, db, None, None, None


bias_gelu_op.register_autograd(_backward, setup_context=_setup_context)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none", dropout_p: float = 0.0,
              seed=None) -> torch.Tensor:
    """``F.dropout(F.gelu(x + bias, approximate=approximate), dropout_p)``; see the module docstring."""
    if seed is None:
        from ._common import new_seed
        seed = new_seed()
    return bias_gelu_op(x, bias, approximate, float(dropout_p), seed)
