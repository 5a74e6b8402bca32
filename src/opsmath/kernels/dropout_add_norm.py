"""``opsmath::dropout_add_norm``: residual + dropout(x), then LayerNorm or RMSNorm, forward and backward.

Math, per row of width N (x, residual: (M, N) after flattening leading dims; weight, bias: (N,))::

    h    = residual + x * keep / (1 - p)          keep = hash(seed, flat index) >= p;  h in x.dtype
    LayerNorm:  mu = mean(h),  rstd = 1 / sqrt(var(h) + eps),  xhat = (h - mu) * rstd
    RMSNorm:    mu = 0,        rstd = 1 / sqrt(mean(h^2) + eps), xhat = h * rstd
    out  = xhat * weight + bias                    (fp32 math, stored as out_dtype)

The op returns (out, h, stats) with stats = (mu, rstd) per row in fp32; h is returned because pre-LN
transformers keep the residual stream. Backward, with g = dout * weight::

    dh   = rstd * (g - mean(g) - xhat * mean(g * xhat))      LayerNorm  (RMSNorm drops the mean(g) term)
    dh  += dh_out                                             gradient arriving at h from later code
    dresidual = dh,   dx = dh * keep / (1 - p)
    dweight = sum_rows(dout * xhat),   dbias = sum_rows(dout)

dx is one pass over the rows; dweight/dbias are per-program partial sums over a strided set of rows
(no atomics) reduced by a second, small torch sum. The dropout mask is regenerated from the seed.
Narrow rows may go several to a program (TILE_M); how many is measured per shape (``_configs``).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from opsmath.kernels._common import (check_seed, dropout_keep, first_order_only, flat_offsets, forced_row_config,
                                     keep_mask, load_seed, new_seed, next_pow2, resident_programs, row_key, row_tile,
                                     seed_arg, tuned_config, use_triton)
from opsmath.kernels._spec import OpSpec, backward, leaf, register

# --------------------------------------------------------------------------------------------------
# PyTorch reference
# --------------------------------------------------------------------------------------------------


def _compute(h):
    """h in the reference's compute dtype: fp32, or fp64 for fp64 inputs."""
    return h.to(torch.promote_types(h.dtype, torch.float32))


def _norm_reference(hf, weight, bias, is_rms, eps):
    """LayerNorm/RMSNorm of hf (..., N) in hf's dtype: returns (y, mu, rstd)."""
    if is_rms:
        mu = torch.zeros_like(hf[..., 0])
        rstd = torch.rsqrt(hf.pow(2).mean(-1) + eps)
    else:
        mu = hf.mean(-1)
        rstd = torch.rsqrt(hf.var(-1, unbiased=False) + eps)
    y = (hf - mu.unsqueeze(-1)) * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.to(hf.dtype)
    if bias is not None:
        y = y + bias.to(hf.dtype)
    return y, mu, rstd


def dropout_add_norm_reference(x, residual, weight, bias, is_rms, eps, dropout_p, seed, out_dtype):
    """Returns (out: out_dtype, h: x.dtype, stats: (M, 2) fp32), x/residual (..., N)."""
    if dropout_p > 0:
        keep = dropout_keep(int(seed), flat_offsets(x.shape, x.device), dropout_p)
        x = x * keep / (1.0 - dropout_p)
    h = residual + x
    y, mu, rstd = _norm_reference(_compute(h), weight, bias, is_rms, eps)
    return y.to(out_dtype), h, torch.stack([mu, rstd], dim=-1).reshape(-1, 2).float()


def dropout_add_norm_backward_reference(dout, dh_out, h, weight, bias, is_rms, eps, dropout_p, seed):
    """(dx, dresidual, dweight, dbias) from the saved h, by the module docstring's formulas in plain
    torch (custom-op bodies run below autograd)."""
    hc = _compute(h)
    _, mu, rstd = _norm_reference(hc, None, None, is_rms, eps)
    xhat = (hc - mu.unsqueeze(-1)) * rstd.unsqueeze(-1)
    dy = dout.to(hc.dtype)
    g = dy * weight.to(hc.dtype) if weight is not None else dy
    dh = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if not is_rms:
        dh = dh - g.mean(-1, keepdim=True)
    dh = dh * rstd.unsqueeze(-1)
    if dh_out is not None:
        dh = dh + dh_out.to(hc.dtype)
    dx = dh.clone()  # a separate tensor even without dropout: op outputs may not alias each other
    if dropout_p > 0:
        dx = dh * dropout_keep(int(seed), flat_offsets(h.shape, h.device), dropout_p) / (1.0 - dropout_p)
    rows = tuple(range(h.dim() - 1))
    dw = (dy * xhat).sum(rows) if weight is not None else None
    db = dy.sum(rows) if bias is not None else None
    return dx.to(h.dtype), dh.to(h.dtype), dw, db


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _dan_fwd(X, R, W, B, Out, Hout, Stats, Seed, M, N, eps, p_drop,
             HAS_W: tl.constexpr, HAS_B: tl.constexpr, IS_RMS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
             TILE_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """TILE_M rows per program (several when rows are narrow, so each program moves ~4096 elements)."""
    seed = load_seed(Seed, HAS_DROPOUT)
    rows = (tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    m = rmask[:, None] & cmask[None, :]
    off = rows[:, None] * N + cols[None, :]
    x = tl.load(X + off, mask=m, other=0.0)
    r = tl.load(R + off, mask=m, other=0.0)
    if HAS_DROPOUT:
        x = tl.where(keep_mask(seed, off, p_drop), x * (1.0 / (1.0 - p_drop)), 0.0).to(x.dtype)
    h = (r + x).to(Hout.dtype.element_ty)  # rounded as eager's add would round it
    tl.store(Hout + off, h, mask=m)
    hf = h.to(tl.float32)
    if IS_RMS:
        mu = tl.sum(hf * 0.0, 1)  # fp32 zeros per row, typed like the LayerNorm branch's mean
        var = tl.sum(hf * hf, 1) / N
    else:
        mu = tl.sum(hf, 1) / N
        d = tl.where(m, hf - mu[:, None], 0.0)
        var = tl.sum(d * d, 1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    y = (hf - mu[:, None]) * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + off, y.to(Out.dtype.element_ty), mask=m)
    tl.store(Stats + rows * 2, mu, mask=rmask)
    tl.store(Stats + rows * 2 + 1, rstd, mask=rmask)


@triton.jit
def _dan_bwd(DOut, DH, Hin, W, Stats, DX, DR, DWp, DBp, Seed, M, N, p_drop,
             HAS_W: tl.constexpr, HAS_DH: tl.constexpr, IS_RMS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
             TILE_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program `pid` handles row tiles pid, pid + G, ... (TILE_M rows each) and writes its partial
    dweight/dbias row."""
    seed = load_seed(Seed, HAS_DROPOUT)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        w = tl.full([BLOCK_N], 1.0, tl.float32)
    dw = tl.zeros([BLOCK_N], tl.float32)
    db = tl.zeros([BLOCK_N], tl.float32)
    for i in range(0, tl.cdiv(tl.cdiv(M, TILE_M) - pid, G)):
        rows = ((pid + i * G).to(tl.int64) * TILE_M + tl.arange(0, TILE_M))
        rmask = rows < M
        m = rmask[:, None] & cmask[None, :]
        off = rows[:, None] * N + cols[None, :]
        dy = tl.load(DOut + off, mask=m, other=0.0).to(tl.float32)
        h = tl.load(Hin + off, mask=m, other=0.0).to(tl.float32)
        mu = tl.load(Stats + rows * 2, mask=rmask, other=0.0)
        rstd = tl.load(Stats + rows * 2 + 1, mask=rmask, other=0.0)
        xhat = tl.where(m, (h - mu[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c2 = tl.sum(g * xhat, 1) / N
        if IS_RMS:
            dh = (g - xhat * c2[:, None]) * rstd[:, None]
        else:
            c1 = tl.sum(g, 1) / N
            dh = (g - c1[:, None] - xhat * c2[:, None]) * rstd[:, None]
        if HAS_DH:
            dh += tl.load(DH + off, mask=m, other=0.0).to(tl.float32)
        tl.store(DR + off, dh.to(DR.dtype.element_ty), mask=m)
        if HAS_DROPOUT:
            dh = tl.where(keep_mask(seed, off, p_drop), dh * (1.0 / (1.0 - p_drop)), 0.0)
        tl.store(DX + off, dh.to(DX.dtype.element_ty), mask=m)
        dw += tl.sum(dy * xhat, 0)
        db += tl.sum(dy, 0)
    tl.store(DWp + pid.to(tl.int64) * N + cols, dw, mask=cmask)
    tl.store(DBp + pid.to(tl.int64) * N + cols, db, mask=cmask)


def _warps(elements: int) -> int:
    return max(1, min(16, elements // 256))


@functools.lru_cache(maxsize=None)   # called at every launch
def _configs(N: int) -> dict[str, int]:
    """Rows per tile (TILE_M) to measure, the default first: one row per program or loop step (the
    fastest on the H200 at widths 768 and 1024 on 2026-11-29, by up to 3x in bf16), two rows, and tiles
    of ``ROW_TILE`` elements. From width 4096 on there is one candidate: a row is the tile."""
    tile_m, _ = row_tile(N)
    return {f"{t}rows": t for t in dict.fromkeys((1, min(2, tile_m), tile_m))}


FILL = 0            # programs per SM: as many as fit at once (``_common.resident_programs``)
_RESIDENT: dict = {}


@functools.lru_cache(maxsize=None)
def _bwd_configs(N: int) -> dict[str, tuple[int, int]]:
    """Backward candidates (TILE_M, programs per SM), the default first: each TILE_M of ``_configs`` at 4
    programs per SM (the fixed grid); one row per step with as many programs as fit on an SM at once
    (one wave, read off the compiled kernel's registers); and at widths under 4096 one row per step at
    16 programs per SM. Why: one program keeps about one row per tensor in flight, and the default
    grid leaves the SM at 16 of 64 warps (static analysis of the sm_90 build: 7 programs of 72 registers x 128 threads
    fit at bf16 width 1024), so narrow rows may want more programs; more programs also mean more
    dweight/dbias partial rows to add, which the timed ``run`` includes: the tuner measures which wins."""
    cands = [(t, 4) for t in _configs(N).values()] + [(1, FILL)]
    if len(_configs(N)) > 1:
        cands.append((1, 16))
    return {f"{t}rows-{g or 'fill'}perSM": (t, g) for t, g in cands}


def _config(op, x, N, is_rms, has_w, has_b, dropout_p, run, configs=None):
    key = row_key(x, N, "rms" if is_rms else "layer", f"w={has_w}", f"b={has_b}", f"dropout={dropout_p > 0}")
    return tuned_config(op, key, configs if configs is not None else _configs(N), run, x.device)


def dropout_add_norm_forward_triton(x, residual, weight, bias, is_rms, eps, dropout_p, seed, out_dtype):
    N = x.shape[-1]
    x2, r2 = x.reshape(-1, N).contiguous(), residual.reshape(-1, N).contiguous()
    M = x2.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=out_dtype)
    h = torch.empty((M, N), device=x.device, dtype=x.dtype)
    stats = torch.empty((M, 2), device=x.device, dtype=torch.float32)
    block_n = next_pow2(N)
    dummy = x2.new_empty(1)

    def run(tile_m):
        _dan_fwd[(triton.cdiv(M, tile_m),)](
            x2, r2, weight if weight is not None else dummy, bias if bias is not None else dummy,
            out, h, stats, seed_arg(seed, x2, dropout_p), M, N, float(eps), float(dropout_p),
            HAS_W=weight is not None, HAS_B=bias is not None, IS_RMS=bool(is_rms),
            HAS_DROPOUT=dropout_p > 0, TILE_M=tile_m, BLOCK_N=block_n, num_warps=_warps(tile_m * block_n))
    if M:
        run(_config("dropout_add_norm_fwd", x2, N, is_rms, weight is not None, bias is not None, dropout_p, run))
    return out.view(x.shape), h.view(x.shape), stats


def dropout_add_norm_backward_triton(dout, dh_out, h, stats, weight, bias, is_rms, dropout_p, seed):
    N = h.shape[-1]
    dout2 = dout.reshape(-1, N).contiguous()
    M = dout2.shape[0]
    dh2 = dh_out.reshape(-1, N).contiguous() if dh_out is not None else dout2
    dx = torch.empty((M, N), device=h.device, dtype=h.dtype)
    dr = torch.empty((M, N), device=h.device, dtype=h.dtype)
    block_n = next_pow2(N)
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 1

    def run(cfg):
        """Launches G programs over the row tiles and sums their (G, N) fp32 dweight/dbias partials
        (part of what the tuner times: more programs mean more partial rows to add)."""
        tile_m, per_sm = cfg
        kwargs = dict(HAS_W=weight is not None, HAS_DH=dh_out is not None, IS_RMS=bool(is_rms),
                      HAS_DROPOUT=dropout_p > 0, TILE_M=tile_m, BLOCK_N=block_n, num_warps=_warps(tile_m * block_n))

        def args(dwp, dbp):
            return (dout2, dh2, h.reshape(-1, N), weight if weight is not None else dout2, stats, dx, dr,
                    dwp, dbp, seed_arg(seed, dout2, dropout_p), M, N, float(dropout_p))
        if per_sm == FILL:   # read off the kernel compiled for these argument dtypes (fp32 partials)
            probe = args(*(torch.empty(1, device=h.device, dtype=torch.float32),) * 2)
            key = (h.device, tuple(getattr(a, "dtype", None) for a in probe), tuple(kwargs.items()))
            if key not in _RESIDENT:
                _RESIDENT[key] = resident_programs(_dan_bwd, probe, kwargs, h.device)
            per_sm = _RESIDENT[key]
        G = max(1, min(triton.cdiv(M, tile_m), sms * per_sm))
        alloc = torch.empty if M else torch.zeros   # every program writes its partial row
        dwp = alloc((G, N), device=h.device, dtype=torch.float32)
        dbp = alloc((G, N), device=h.device, dtype=torch.float32)
        if M:
            _dan_bwd[(G,)](*args(dwp, dbp), **kwargs)
        return (dwp.sum(0).to(weight.dtype) if weight is not None else None,
                dbp.sum(0).to(bias.dtype) if bias is not None else None)
    cfg = _config("dropout_add_norm_bwd", h, N, is_rms, weight is not None, bias is not None, dropout_p, run,
                  _bwd_configs(N)) if M else (1, 4)
    dw, db = run(cfg)
    return dx.view(h.shape), dr.view(h.shape), dw, db


# --------------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("opsmath::dropout_add_norm", mutates_args=())
def dropout_add_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor],
                        bias: Optional[torch.Tensor], is_rms: bool, eps: float, dropout_p: float,
                        seed: Optional[torch.Tensor], out_dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.dtype != residual.dtype or x.shape != residual.shape:
        raise ValueError(f"opsmath::dropout_add_norm needs x and residual of one dtype and shape, got "
                         f"{x.dtype}{tuple(x.shape)} and {residual.dtype}{tuple(residual.shape)}")
    check_seed("dropout_add_norm", dropout_p, seed)
    if use_triton(x):
        out, h, stats = dropout_add_norm_forward_triton(x, residual, weight, bias, is_rms, eps, dropout_p, seed,
                                                        out_dtype)
    else:
        out, h, stats = dropout_add_norm_reference(x, residual, weight, bias, is_rms, eps, dropout_p, seed,
                                                   out_dtype)
    return out.contiguous(), h.contiguous(), stats.contiguous()


@dropout_add_norm_op.register_fake
def _(x, residual, weight, bias, is_rms, eps, dropout_p, seed, out_dtype):
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape),
            x.new_empty((M, 2), dtype=torch.float32))


@torch.library.custom_op("opsmath::dropout_add_norm_backward", mutates_args=())
def dropout_add_norm_backward_op(dout: torch.Tensor, dh_out: Optional[torch.Tensor], h: torch.Tensor,
                                 stats: torch.Tensor, weight: Optional[torch.Tensor],
                                 bias: Optional[torch.Tensor], is_rms: bool, eps: float, dropout_p: float,
                                 seed: Optional[torch.Tensor]
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dresidual, dweight, dbias); dweight/dbias are empty when weight/bias are None."""
    if use_triton(h):
        dx, dr, dw, db = dropout_add_norm_backward_triton(dout, dh_out, h, stats, weight, bias, is_rms,
                                                          dropout_p, seed)
    else:
        dx, dr, dw, db = dropout_add_norm_backward_reference(dout, dh_out, h, weight, bias, is_rms, eps,
                                                             dropout_p, seed)
    def empty():  # a fresh one each time: op outputs may not alias each other
        return h.new_empty((0,), dtype=torch.float32)
    return (dx.contiguous(), dr.contiguous(),
            dw.to(weight.dtype).contiguous() if dw is not None else empty(),
            db.to(bias.dtype).contiguous() if db is not None else empty())


@dropout_add_norm_backward_op.register_fake
def _(dout, dh_out, h, stats, weight, bias, is_rms, eps, dropout_p, seed):
    return (h.new_empty(h.shape), h.new_empty(h.shape),
            weight.new_empty(weight.shape) if weight is not None else h.new_empty((0,), dtype=torch.float32),
            bias.new_empty(bias.shape) if bias is not None else h.new_empty((0,), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    _, _, weight, bias, is_rms, eps, dropout_p, seed, _ = inputs
    _, h, stats = output
    # h and the per-row stats are all backward needs; the mask comes back from the seed
    ctx.save_for_backward(h, stats, weight, bias, seed)
    ctx.args = (is_rms, eps, dropout_p)


def _backward(ctx, dout, dh_out, dstats):
    first_order_only("dropout_add_norm")
    h, stats, weight, bias, seed = ctx.saved_tensors
    is_rms, eps, dropout_p = ctx.args
    dx, dr, dw, db = dropout_add_norm_backward_op(dout, dh_out, h, stats, weight, bias, is_rms, eps,
                                                  dropout_p, seed)
    return (dx, dr, dw if weight is not None else None, db if bias is not None else None,
            None, None, None, None, None)


dropout_add_norm_op.register_autograd(_backward, setup_context=_setup_context)


def dropout_add_norm(x, residual, weight=None, bias=None, is_rms=False, eps=1e-5, dropout_p=0.0, seed=None,
                     out_dtype=None):
    """Convenience entry point returning (out, h); see the module docstring for the math."""
    if seed is None and dropout_p > 0:
        seed = new_seed(x)
    out, h, _ = dropout_add_norm_op(x, residual, weight, bias, is_rms, eps, dropout_p, seed,
                                    out_dtype or x.dtype)
    return out, h


# --------------------------------------------------------------------------------------------------
# Op spec (src/opsmath/kernels/_spec.py)
# --------------------------------------------------------------------------------------------------


def _exercise(dtype: torch.dtype) -> None:
    seed = torch.tensor(7)

    def run(rms, p, w, b):
        out, h, _ = dropout_add_norm_op(leaf(6, 48, dtype=dtype), leaf(6, 48, dtype=dtype), w, b, rms, 1e-5, p,
                                        seed, dtype)
        backward(out.float().sum() + h.float().sum())
    for rms, p, affine in ((False, 0.1, True), (True, 0.0, True), (False, 0.0, False)):
        run(rms, p, leaf(48, dtype=dtype) if affine else None, leaf(48, dtype=dtype) if affine and not rms else None)
    for i in range(3):   # every launch configuration the row-kernel tuner may pick
        with forced_row_config(i):
            run(False, 0.1, leaf(48, dtype=dtype), leaf(48, dtype=dtype))


# Inside models Inductor fuses the residual add and norm into the neighbouring kernels: on the H200 this
# op cost 18 ms per GPT-2-small step under Inductor (48.2 vs 30.1 ms, BENCHMARKS.md)
SPEC = register(OpSpec("dropout_add_norm", ops=(torch.ops.opsmath.dropout_add_norm.default,),
                       inductor_fuses_better=True, exercise=_exercise,
                       profile=("norm", ("_dan_", "dropout_add_norm", "layer_norm", "rms_norm", "rsqrt")),
                       saves="the sum h in the input dtype and fp32 row statistics; the dropout mask is regenerated"))
