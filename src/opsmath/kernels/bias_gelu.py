"""``opsmath::bias_gelu``: ``dropout(gelu(x + bias))`` in the erf or tanh form, forward and backward.

Math, with z = x + bias (fp32 math, y stored in x's dtype), k = sqrt(2/pi), c = 0.044715::

    erf:   y = z/2 (1 + erf(z / sqrt 2))           y' = (1 + erf(z / sqrt 2))/2 + z exp(-z^2/2) / sqrt(2 pi)
    tanh:  t = tanh(k (z + c z^3)),  y = z/2 (1 + t)   y' = (1 + t)/2 + z/2 (1 - t^2) k (1 + 3 c z^2)
    out = y * keep / (1 - p)       keep = hash(seed, flat index) >= p  (``_common.keep_mask``; p = 0: out = y)
    dx = dout * keep / (1 - p) * y',   dbias = sum over rows of dx

Shapes: x (..., N), bias (N,) -> out (..., N) in x's dtype; dbias in bias's dtype.

The pattern (``src/opsmath/patterns/bias_gelu.py``) takes the bias out of ``linear(x, W, b) -> gelu``: the GEMM runs
without it and this op adds it on the way into the GELU. Forward moves what the GELU alone moved (read
x, write y); backward computes dx and the bias gradient in one pass over dy and x instead of writing dx
and reading it again for the bias sum. Both kernels loop over (TILE_M, BLOCK_N) tiles, ROWS rows per
program; the tile, rows and warps are measured per shape (``_configs``, ``_common.tuned_config``).
dbias is reduced without atomics: each backward program sums its rows into an fp32 partial row, and a
small torch sum adds the partials. With dropout (timm's
``Mlp``: fc1 -> act -> drop) no mask is stored: backward regenerates it from the seed, so what is saved
is x and the seed, against eager's pre-activation, GELU output and boolean mask.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from opsmath.kernels._common import (check_seed, dropout_keep, first_order_only, flat_offsets, forced_row_config,
                                     keep_mask, load_seed, new_seed, row_key, row_tile, seed_arg, tuned_config,
                                     use_triton)
from opsmath.kernels._spec import OpSpec, backward, leaf, register

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
def _bias_gelu_fwd(x_ptr, b_ptr, y_ptr, M, N, Seed, p, ROWS: tl.constexpr, TILE_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, TANH: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """ROWS rows per program, one (TILE_M, BLOCK_N) tile per loop step."""
    seed = load_seed(Seed, HAS_DROPOUT)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    for i in range(ROWS // TILE_M):
        rows = (tl.program_id(0) * ROWS + i * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
        m = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
        z = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32) + bias[None, :]
        y, _ = _gelu_and_grad(z, TANH)
        y = y * _dropout_scale(seed, offs, p, HAS_DROPOUT)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bias_gelu_bwd(dy_ptr, x_ptr, b_ptr, dx_ptr, dbp_ptr, M, N, Seed, p, ROWS: tl.constexpr,
                   TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, TANH: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """ROWS rows per program in (TILE_M, BLOCK_N) tiles; the program's fp32 partial of dbias (its rows
    summed) goes to row ``program_id(0)`` of ``dbp``."""
    seed = load_seed(Seed, HAS_DROPOUT)
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


class _Cfg(NamedTuple):
    """A launch: (TILE_M, BLOCK_N) tiles, ROWS rows per program (a multiple of TILE_M), num_warps."""
    tile_m: int
    block_n: int
    rows: int
    warps: int


@functools.lru_cache(maxsize=None)   # called at every launch
def _configs(N: int, backward: bool) -> dict[str, _Cfg]:
    """Candidates, the default first: tiles of ``ROW_TILE`` elements at 8 warps (the backward's dbias
    partial sums 16 rows), half tiles at 4 warps, and one row per loop step over 32 rows at 4 warps
    (the first retiled kernels). On the H200 (2026-11-29) the first was fastest in fp32 at every width and in
    bf16 up to 1024, the last in bf16 at 4096 and 8192, so the choice is measured per shape."""
    tile_m, block_n = row_tile(N, max_block_n=1024)
    half = max(1, tile_m // 2)
    cands = [_Cfg(tile_m, block_n, max(16, tile_m) if backward else tile_m, 8),
             _Cfg(half, block_n, max(16, half) if backward else half, 4),
             _Cfg(1, block_n, 32, 4)]
    return {f"{c.tile_m}x{c.block_n}r{c.rows}w{c.warps}": c for c in cands}


def _config(op, x, N, approximate, dropout_p, run) -> _Cfg:
    key = row_key(x, N, approximate, f"dropout={dropout_p > 0}")
    return tuned_config(op, key, _configs(N, op.endswith("bwd")), run, x.device)


def _fwd(x, bias, y, M, N, seed, p, approximate, cfg: _Cfg):
    grid = (triton.cdiv(M, cfg.rows), triton.cdiv(N, cfg.block_n))
    _bias_gelu_fwd[grid](x, bias, y, M, N, seed_arg(seed, x, p), float(p), ROWS=cfg.rows, TILE_M=cfg.tile_m,
                         BLOCK_N=cfg.block_n, TANH=approximate == "tanh", HAS_DROPOUT=p > 0, num_warps=cfg.warps)


def _bwd(dy, x, bias, dx, M, N, seed, p, approximate, cfg: _Cfg):
    """Launches the backward; returns the (programs, N) fp32 dbias partials."""
    grid = (triton.cdiv(M, cfg.rows), triton.cdiv(N, cfg.block_n))
    dbp = torch.empty((grid[0], N), device=x.device, dtype=torch.float32)
    _bias_gelu_bwd[grid](dy, x, bias, dx, dbp, M, N, seed_arg(seed, x, p), float(p), ROWS=cfg.rows, TILE_M=cfg.tile_m,
                         BLOCK_N=cfg.block_n, TANH=approximate == "tanh", HAS_DROPOUT=p > 0, num_warps=cfg.warps)
    return dbp


def bias_gelu_forward_triton(x, bias, approximate, dropout_p=0.0, seed=0):
    N = x.shape[-1]
    x, bias = x.contiguous(), bias.contiguous()
    y = torch.empty_like(x)
    M = x.numel() // N if N else 0
    if M:
        def run(cfg):
            _fwd(x, bias, y, M, N, seed, dropout_p, approximate, cfg)
        run(_config("bias_gelu_fwd", x, N, approximate, dropout_p, run))
    return y


def bias_gelu_backward_triton(dy, x, bias, approximate, dropout_p=0.0, seed=0):
    N = x.shape[-1]
    x, dy, bias = x.contiguous(), dy.contiguous(), bias.contiguous()
    dx = torch.empty_like(x)
    M = x.numel() // N if N else 0
    if not M:
        return dx, torch.zeros_like(bias)

    def run(cfg):
        return _bwd(dy, x, bias, dx, M, N, seed, dropout_p, approximate, cfg)
    dbp = run(_config("bias_gelu_bwd", x, N, approximate, dropout_p, run))
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
                 seed: Optional[torch.Tensor]) -> torch.Tensor:
    _check(x, bias, approximate, dropout_p)
    check_seed("bias_gelu", dropout_p, seed)
    if use_triton(x):
        return bias_gelu_forward_triton(x, bias, approximate, dropout_p, seed)
    return bias_gelu_reference(x, bias, approximate, dropout_p, seed).contiguous()


@bias_gelu_op.register_fake
def _(x, bias, approximate, dropout_p, seed):
    _check(x, bias, approximate, dropout_p)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("opsmath::bias_gelu_backward", mutates_args=())
def bias_gelu_backward_op(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str,
                          dropout_p: float, seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        dx, db = bias_gelu_backward_triton(dy, x, bias, approximate, dropout_p, seed)
    else:
        dx, db = bias_gelu_backward_reference(dy, x, bias, approximate, dropout_p, seed)
    return dx.contiguous(), db.contiguous()


@bias_gelu_backward_op.register_fake
def _(dy, x, bias, approximate, dropout_p, seed):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(bias)


def _setup_context(ctx, inputs, output):
    x, bias, approximate, dropout_p, seed = inputs
    ctx.save_for_backward(x, bias, seed)
    ctx.args = (approximate, dropout_p)


def _backward(ctx, dy):
    first_order_only("bias_gelu")
    x, bias, seed = ctx.saved_tensors
    dx, db = bias_gelu_backward_op(dy, x, bias, *ctx.args, seed)
    return dx, db, None, None, None


bias_gelu_op.register_autograd(_backward, setup_context=_setup_context)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none", dropout_p: float = 0.0,
              seed=None) -> torch.Tensor:
    """``F.dropout(F.gelu(x + bias, approximate=approximate), dropout_p)``; see the module docstring."""
    if seed is None and dropout_p > 0:
        seed = new_seed(x)
    return bias_gelu_op(x, bias, approximate, float(dropout_p), seed)


# --------------------------------------------------------------------------------------------------
# Op spec (src/opsmath/kernels/_spec.py)
# --------------------------------------------------------------------------------------------------


def _exercise(dtype: torch.dtype) -> None:
    seed = torch.tensor(7)
    for approx in ("none", "tanh"):
        for p in (0.0, 0.1):
            backward(bias_gelu(leaf(5, 40, dtype=dtype), leaf(40, dtype=dtype), approx, p, seed))
    for i in range(3):   # every launch configuration the row-kernel tuner may pick
        with forced_row_config(i):
            backward(bias_gelu(leaf(5, 40, dtype=dtype), leaf(40, dtype=dtype), "none", 0.1, seed))


# pointwise: Inductor fuses it with its neighbours, what it does best
SPEC = register(OpSpec("bias_gelu", ops=(torch.ops.opsmath.bias_gelu.default,), inductor_fuses_better=True,
                       exercise=_exercise,
                       saves="the pre-activation; GELU and its derivative are recomputed"))
