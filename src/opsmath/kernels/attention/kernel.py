"""Triton kernels of ``opsmath::attention`` (math, shapes and caveats: ``attention.py``'s docstring):
a FlashAttention-2 style forward with online softmax, and a backward in two kernels (dQ (and dBias) per
query block, which also computes ``delta = rowsum(dO * O)`` for its rows, then dK/dV per key block),
launched by ``attention_forward_triton`` / ``attention_backward_triton``.
"""
from __future__ import annotations

import torch
from torch.library import wrap_triton
import triton
import triton.language as tl

from opsmath.kernels._common import keep_mask, launch_precision, load_seed, seed_arg
from opsmath.kernels.attention.configs import bias_mask_args, bucket, launch_cfg


@triton.jit
def _tile(base, rows, n_rows, offs_d, D, s_row, s_d):
    """The (len(rows), BLOCK_D) tile ``base[rows, :D]`` of a strided matrix, zero outside it;
    row offsets in int64 so tensors past 2**31 elements index correctly."""
    return tl.load(base + rows[:, None].to(tl.int64) * s_row + offs_d[None, :] * s_d,
                   mask=(rows[:, None] < n_rows) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _scores(q, k, b, h, rows, cols, Bias, Mask, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
            H, SQ, SK, scale, softcap, mask_fill, seed, p_drop, window,
            HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
            HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, CHECK: tl.constexpr):
    """Scores block S (BM, BN) fp32 with softcap/bias/mask/causal applied, whether each entry is
    masked, the dropout keep-mask (all-true when there is no dropout) and dS_capped/dS_raw = 1 - t^2
    (t = tanh(scale QK^T / softcap); 1.0 without softcap). ``CHECK=False`` is for blocks the caller knows
    lie wholly inside the keys and below the causal diagonal: no bounds or causal test."""
    s = tl.dot(q, k, input_precision=PRECISION) * scale
    dcap = 1.0
    if SOFTCAP:
        t = 2.0 * tl.sigmoid(s * (2.0 / softcap)) - 1.0     # tanh(s / softcap)
        s = softcap * t
        dcap = 1.0 - t * t
    inb = (rows[:, None] < SQ) & (cols[None, :] < SK)
    if HAS_BIAS == 2:   # a per-key bias (query stride 0: ALiBi): one row of BN values, broadcast over rows
        s += tl.load(Bias + b * sbb + h * sbh + cols.to(tl.int64) * sbn, mask=cols < SK, other=0.0).to(tl.float32)[None, :]
    elif HAS_BIAS:
        bp = Bias + b * sbb + h * sbh + rows[:, None].to(tl.int64) * sbm + cols[None, :].to(tl.int64) * sbn
        s += tl.load(bp, mask=inb, other=0.0).to(tl.float32)
    if CHECK:
        invalid = cols[None, :] >= SK
        if IS_CAUSAL:
            invalid = invalid | (cols[None, :] > rows[:, None])
        if WINDOW:
            invalid = invalid | (cols[None, :] <= rows[:, None] - window)
    else:
        invalid = cols[None, :] < 0     # nothing: the block is wholly valid
    masked = invalid
    if HAS_MASK:
        mp = Mask + b * smb + h * smh + rows[:, None].to(tl.int64) * smm + cols[None, :].to(tl.int64) * smn
        user = tl.load(mp, mask=inb, other=0) != 0
        s = tl.where(user, mask_fill, s)
        masked = masked | user
    if CHECK:
        s = tl.where(invalid, float("-inf"), s)
    keep = inb
    if HAS_DROPOUT:
        offs = ((b * H + h) * SQ + rows[:, None].to(tl.int64)) * SK + cols[None, :].to(tl.int64)
        keep = keep_mask(seed, offs, p_drop)
    return s, masked, keep, dcap


@triton.jit
def _key_ranges(pid_m, SK, window, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """(lo, edge, full, hi) for a query block, in multiples of BLOCK_N: key blocks before ``lo`` lie wholly
    left of the sliding window (skipped); [lo, edge) straddle its left edge (tested); [edge, full) lie inside
    the keys, the window and wholly below the diagonal (every column <= the block's first row; untested);
    [full, hi) need the bounds/causal test; from ``hi`` on they lie wholly above the diagonal (skipped)."""
    if IS_CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
        full = tl.minimum(((pid_m * BLOCK_M + 1) // BLOCK_N) * BLOCK_N, (SK // BLOCK_N) * BLOCK_N)
    else:
        hi = SK
        full = (SK // BLOCK_N) * BLOCK_N
    lo = full * 0
    edge = lo
    if WINDOW:   # row r sees columns > r - window: the block's first row from r0 - window + 1 on
        lo = (tl.maximum(pid_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
        # and every row of the block sees column c once c > (r0 + BLOCK_M - 1) - window
        edge = tl.cdiv(tl.maximum(pid_m * BLOCK_M + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N
        edge = tl.minimum(tl.maximum(edge, lo), full)
    return lo, edge, full, hi


@triton.jit
def _fwd_blocks(acc, m_i, l_i, q, K, V, Bias, Mask, b, h, g, rows, start, end, offs_n, offs_d, dmask,
                skb, skh, skn, skd, svb, svh, svn, svd, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                H, SQ, SK, D, scale, softcap, mask_fill, seed, p_drop, window,
                HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, CHECK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over the key blocks [start, end) of one query block."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        # K^T loaded directly as (BLOCK_D, BLOCK_N): loading K and tl.trans-ing it measured 34-39%
        # slower at D=64 on the H200 (BENCHMARKS.md, attention run 2)
        kt = tl.load(K + b * skb + g * skh + cols[None, :].to(tl.int64) * skn + offs_d[:, None] * skd,
                     mask=(cols[None, :] < SK) & dmask[:, None], other=0.0)
        s, masked, keep, dcap = _scores(q, kt, b, h, rows, cols, Bias, Mask, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                                  H, SQ, SK, scale, softcap, mask_fill, seed, p_drop, window,
                                  HAS_BIAS, HAS_MASK, IS_CAUSAL, WINDOW, HAS_DROPOUT, SOFTCAP, PRECISION, CHECK)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows masked so far: keep exp finite
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            p = tl.where(keep, p * (1.0 / (1.0 - p_drop)), 0.0)
        v = _tile(V + b * svb + g * svh, cols, SK, offs_d, D, svn, svd)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _query_block(H, REP, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's query block (grid: query blocks x B*H): its index, the flat (b, h) index, batch b,
    head h, kv head g, its rows, and the key and head-dim offsets."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return pid_m, pid_bh, b, h, h // REP, rows, tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)


@triton.jit
def _fp32(scale, softcap, mask_fill, p_drop):
    """The float arguments in fp32, however the launcher typed them: Inductor, launching the kernels from its
    own code, passes Python floats as fp64 (and a 1.0 as a constant), which would carry fp64 through the
    loops."""
    return (tl.cast(scale, tl.float32), tl.cast(softcap, tl.float32), tl.cast(mask_fill, tl.float32),
            tl.cast(p_drop, tl.float32))


@triton.jit
def _attn_fwd(Q, K, V, Bias, Mask, Out, Stats, Seed,
              sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
              sbb, sbh, sbm, sbn, smb, smh, smm, smn, sob, soh, som, sod,
              H, REP, SQ, SK, D, scale, softcap, mask_fill, p_drop, window,
              HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    scale, softcap, mask_fill, p_drop = _fp32(scale, softcap, mask_fill, p_drop)
    pid_m, pid_bh, b, h, g, rows, offs_n, offs_d = _query_block(H, REP, BLOCK_M, BLOCK_N, BLOCK_D)
    seed = load_seed(Seed, HAS_DROPOUT)
    dmask = offs_d < D
    q = _tile(Q + b * sqb + h * sqh, rows, SQ, offs_d, D, sqm, sqd)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, edge, full, hi = _key_ranges(pid_m, SK, window, IS_CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, K, V, Bias, Mask, b, h, g, rows, lo, edge, offs_n, offs_d, dmask,
                                skb, skh, skn, skd, svb, svh, svn, svd, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                                H, SQ, SK, D, scale, softcap, mask_fill, seed, p_drop, window, HAS_BIAS, HAS_MASK, IS_CAUSAL, WINDOW,
                                HAS_DROPOUT, SOFTCAP, PRECISION, True, BLOCK_N)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, K, V, Bias, Mask, b, h, g, rows, edge, full, offs_n, offs_d, dmask,
                                skb, skh, skn, skd, svb, svh, svn, svd, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                                H, SQ, SK, D, scale, softcap, mask_fill, seed, p_drop, window, HAS_BIAS, HAS_MASK, IS_CAUSAL, WINDOW,
                                HAS_DROPOUT, SOFTCAP, PRECISION, False, BLOCK_N)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, K, V, Bias, Mask, b, h, g, rows, full, hi, offs_n, offs_d, dmask,
                                skb, skh, skn, skd, svb, svh, svn, svd, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                                H, SQ, SK, D, scale, softcap, mask_fill, seed, p_drop, window, HAS_BIAS, HAS_MASK, IS_CAUSAL, WINDOW,
                                HAS_DROPOUT, SOFTCAP, PRECISION, True, BLOCK_N)
    dead = l_i == 0.0   # every entry -inf: output 0 and stats (0, +inf), so backward's P is 0 (SDPA's rows)
    out = acc / tl.where(dead, 1.0, l_i)[:, None]
    rmask = rows < SQ
    tl.store(Out + b * sob + h * soh + rows[:, None].to(tl.int64) * som + offs_d[None, :] * sod,
             out.to(Out.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    srow = (pid_bh.to(tl.int64) * SQ + rows) * 2
    tl.store(Stats + srow, tl.where(dead, 0.0, m_i), mask=rmask)
    tl.store(Stats + srow + 1, tl.where(dead, float("inf"), tl.log(l_i)), mask=rmask)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, Q, DO, Stats, Delta, Bias, Mask, b, h, cols, start, end, offs_m, offs_d,
                 sqb, sqh, sqm, sqd, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                 H, SQ, SK, D, scale, softcap, mask_fill, seed, p_drop, window,
                 HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, CHECK: tl.constexpr, BLOCK_M: tl.constexpr):
    """dK/dV contributions of query head h's row blocks [start, end) to one key block."""
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m
        q = _tile(Q + b * sqb + h * sqh, rows, SQ, offs_d, D, sqm, sqd)
        do = _tile(DO + (b * H + h) * SQ * D, rows, SQ, offs_d, D, D, 1)
        srow = ((b * H + h) * SQ + rows) * 2
        m_row = tl.load(Stats + srow, mask=rows < SQ, other=0.0)
        logl = tl.load(Stats + srow + 1, mask=rows < SQ, other=0.0)
        delta = tl.load(Delta + (b * H + h) * SQ + rows, mask=rows < SQ, other=0.0)
        s, masked, keep, dcap = _scores(q, tl.trans(k), b, h, rows, cols, Bias, Mask, sbb, sbh, sbm, sbn,
                                  smb, smh, smm, smn, H, SQ, SK, scale, softcap, mask_fill, seed, p_drop, window,
                                  HAS_BIAS, HAS_MASK, IS_CAUSAL, WINDOW, HAS_DROPOUT, SOFTCAP, PRECISION, CHECK)
        p = tl.where(rows[:, None] < SQ, tl.exp((s - m_row[:, None]) - logl[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if HAS_DROPOUT:
            pd = tl.where(keep, p * (1.0 / (1.0 - p_drop)), 0.0)
            dp = tl.where(keep, dp * (1.0 / (1.0 - p_drop)), 0.0)
        else:
            pd = p
        dv += tl.dot(tl.trans(pd.to(do.dtype)), do, input_precision=PRECISION)
        ds = tl.where(masked, 0.0, p * (dp - delta[:, None])) * dcap
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, Bias, Mask, DO, Stats, Delta, DK, DV, Seed,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                   sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                   HKV, H, REP, SQ, SK, D, scale, softcap, mask_fill, p_drop, window,
                   HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                   HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (kv block, batch, kv head); loops over the REP query heads sharing it (GQA),
    so dK/dV are summed in registers with no atomics. dO/dK/dV/Q share Q's contiguous layout."""
    scale, softcap, mask_fill, p_drop = _fp32(scale, softcap, mask_fill, p_drop)
    pid_n = tl.program_id(0)
    seed = load_seed(Seed, HAS_DROPOUT)
    pid_bg = tl.program_id(1)
    b = (pid_bg // HKV).to(tl.int64)
    g = (pid_bg % HKV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    kv_mask = (cols[:, None] < SK) & dmask[None, :]
    k = _tile(K + b * skb + g * skh, cols, SK, offs_d, D, skn, skd)
    v = _tile(V + b * svb + g * svh, cols, SK, offs_d, D, svn, svd)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    n0 = pid_n * BLOCK_N
    lo = 0
    full = 0
    if IS_CAUSAL:
        lo = (n0 // BLOCK_M) * BLOCK_M  # query rows above this block see none of it
        # from here on every row of a query block sees every column of this key block
        full = ((n0 + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if n0 + BLOCK_N > SK:
        full = SQ                       # a partial key block: every query block tests the bounds
    rhi = SQ + lo * 0
    wend = rhi
    if WINDOW:   # rows past n0 + BLOCK_N - 1 + window - 1 see none of it; rows before wend see all of it
        rhi = tl.minimum(SQ, n0 + BLOCK_N + window - 1)
        wend = ((n0 + window) // BLOCK_M) * BLOCK_M
    for r in range(0, REP):
        h = g * REP + r
        dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, Stats, Delta, Bias, Mask, b, h, cols, lo, tl.minimum(full, rhi),
                              offs_m, offs_d, sqb, sqh, sqm, sqd, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                              H, SQ, SK, D, scale, softcap, mask_fill, seed, p_drop, window, HAS_BIAS, HAS_MASK, IS_CAUSAL, WINDOW,
                              HAS_DROPOUT, SOFTCAP, PRECISION, True, BLOCK_M)
        dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, Stats, Delta, Bias, Mask, b, h, cols, full, tl.minimum(wend, rhi),
                              offs_m, offs_d, sqb, sqh, sqm, sqd, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                              H, SQ, SK, D, scale, softcap, mask_fill, seed, p_drop, window, HAS_BIAS, HAS_MASK, IS_CAUSAL, WINDOW,
                              HAS_DROPOUT, SOFTCAP, PRECISION, False, BLOCK_M)
        if WINDOW:
            dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, Stats, Delta, Bias, Mask, b, h, cols, tl.maximum(full, wend),
                                  rhi, offs_m, offs_d, sqb, sqh, sqm, sqd, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                                  H, SQ, SK, D, scale, softcap, mask_fill, seed, p_drop, window, HAS_BIAS, HAS_MASK,
                                  IS_CAUSAL, WINDOW, HAS_DROPOUT, SOFTCAP, PRECISION, True, BLOCK_M)
    out_off = (b * HKV + g) * SK * D + cols[:, None].to(tl.int64) * D + offs_d[None, :]
    tl.store(DK + out_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_blocks(dq, q, do, m_row, logl, delta, K, V, Bias, Mask, DBias, b, h, g, pid_bh, rows, start, end,
               offs_n, offs_d, skb, skh, skn, skd, svb, svh, svn, svd, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
               H, SQ, SK, D, scale, softcap, mask_fill, seed, p_drop, window,
               HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, BIAS_GRAD: tl.constexpr, PRECISION: tl.constexpr,
               CHECK: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ (and dbias) contributions of the key blocks [start, end) to one query block."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k = _tile(K + b * skb + g * skh, cols, SK, offs_d, D, skn, skd)
        v = _tile(V + b * svb + g * svh, cols, SK, offs_d, D, svn, svd)
        s, masked, keep, dcap = _scores(q, tl.trans(k), b, h, rows, cols, Bias, Mask, sbb, sbh, sbm, sbn,
                                  smb, smh, smm, smn, H, SQ, SK, scale, softcap, mask_fill, seed, p_drop, window,
                                  HAS_BIAS, HAS_MASK, IS_CAUSAL, WINDOW, HAS_DROPOUT, SOFTCAP, PRECISION, CHECK)
        p = tl.exp((s - m_row[:, None]) - logl[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if HAS_DROPOUT:
            dp = tl.where(keep, dp * (1.0 / (1.0 - p_drop)), 0.0)
        ds = tl.where(masked, 0.0, p * (dp - delta[:, None]))
        if BIAS_GRAD:
            inb = (rows[:, None] < SQ) & (cols[None, :] < SK)
            tl.store(DBias + (pid_bh.to(tl.int64) * SQ + rows[:, None]) * SK + cols[None, :], ds, mask=inb)
        dq += tl.dot((ds * dcap).to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _zero_dbias(DBias, pid_bh, rows, offs_n, start, end, SQ, SK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Blocks skipped outside the causal diagonal or the window still need their (zero) bias gradient."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        inb = (rows[:, None] < SQ) & (cols[None, :] < SK)
        tl.store(DBias + (pid_bh.to(tl.int64) * SQ + rows[:, None]) * SK + cols[None, :],
                 tl.zeros([BLOCK_M, BLOCK_N], tl.float32), mask=inb)


@triton.jit
def _attn_bwd_dq(Q, K, V, Bias, Mask, DO, Out, Stats, Delta, DQ, DBias, Seed,
                 sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                 sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                 H, REP, SQ, SK, D, scale, softcap, mask_fill, p_drop, window,
                 HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, BIAS_GRAD: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    scale, softcap, mask_fill, p_drop = _fp32(scale, softcap, mask_fill, p_drop)
    pid_m, pid_bh, b, h, g, rows, offs_n, offs_d = _query_block(H, REP, BLOCK_M, BLOCK_N, BLOCK_D)
    seed = load_seed(Seed, HAS_DROPOUT)
    qmask = (rows[:, None] < SQ) & (offs_d[None, :] < D)
    q = _tile(Q + b * sqb + h * sqh, rows, SQ, offs_d, D, sqm, sqd)
    do = _tile(DO + pid_bh.to(tl.int64) * SQ * D, rows, SQ, offs_d, D, D, 1)
    srow = (pid_bh.to(tl.int64) * SQ + rows) * 2
    m_row = tl.load(Stats + srow, mask=rows < SQ, other=0.0)
    logl = tl.load(Stats + srow + 1, mask=rows < SQ, other=0.0)
    # delta = rowsum(dO * O), computed here for this block's rows and stored for the dK/dV kernel (launched
    # after this one): no separate pass over dO and O in fp32
    o = _tile(Out + pid_bh.to(tl.int64) * SQ * D, rows, SQ, offs_d, D, D, 1)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(Delta + pid_bh.to(tl.int64) * SQ + rows, delta, mask=rows < SQ)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, edge, full, hi = _key_ranges(pid_m, SK, window, IS_CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    dq = _dq_blocks(dq, q, do, m_row, logl, delta, K, V, Bias, Mask, DBias, b, h, g, pid_bh, rows, lo, edge,
                    offs_n, offs_d, skb, skh, skn, skd, svb, svh, svn, svd, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                    H, SQ, SK, D, scale, softcap, mask_fill, seed, p_drop, window, HAS_BIAS, HAS_MASK, IS_CAUSAL, WINDOW, HAS_DROPOUT, SOFTCAP,
                    BIAS_GRAD, PRECISION, True, BLOCK_N)
    dq = _dq_blocks(dq, q, do, m_row, logl, delta, K, V, Bias, Mask, DBias, b, h, g, pid_bh, rows, edge, full,
                    offs_n, offs_d, skb, skh, skn, skd, svb, svh, svn, svd, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                    H, SQ, SK, D, scale, softcap, mask_fill, seed, p_drop, window, HAS_BIAS, HAS_MASK, IS_CAUSAL, WINDOW, HAS_DROPOUT, SOFTCAP,
                    BIAS_GRAD, PRECISION, False, BLOCK_N)
    dq = _dq_blocks(dq, q, do, m_row, logl, delta, K, V, Bias, Mask, DBias, b, h, g, pid_bh, rows, full, hi,
                    offs_n, offs_d, skb, skh, skn, skd, svb, svh, svn, svd, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                    H, SQ, SK, D, scale, softcap, mask_fill, seed, p_drop, window, HAS_BIAS, HAS_MASK, IS_CAUSAL, WINDOW, HAS_DROPOUT, SOFTCAP,
                    BIAS_GRAD, PRECISION, True, BLOCK_N)
    if BIAS_GRAD and (IS_CAUSAL or WINDOW):
        _zero_dbias(DBias, pid_bh, rows, offs_n, 0, lo, SQ, SK, BLOCK_M, BLOCK_N)
        _zero_dbias(DBias, pid_bh, rows, offs_n, hi, SK, SQ, SK, BLOCK_M, BLOCK_N)
    tl.store(DQ + (pid_bh.to(tl.int64) * SQ + rows[:, None]) * D + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=qmask)


def attention_forward_triton(q, k, v, bias, mask, mask_fill, is_causal, scale, dropout_p, seed, softcap=0.0,
                             window=0):
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    out = torch.empty((B, H, Sq, D), device=q.device, dtype=q.dtype)
    stats = torch.empty((B, H, Sq, 2), device=q.device, dtype=torch.float32)
    b, m, bs, ms, has_bias = bias_mask_args(q, k, bias, mask)
    BM, BN, BD, warps, stages = launch_cfg(q, D, bucket(q, k, bias, mask, is_causal, dropout_p, softcap, window), "fwd")
    grid = (triton.cdiv(Sq, BM), B * H)
    wrap_triton(_attn_fwd)[grid](q, k, v, b, m, out, stats, seed_arg(seed, q, dropout_p),
                    *q.stride(), *k.stride(), *v.stride(), *bs, *ms, *out.stride(),
                    H, H // Hkv, Sq, Sk, D, float(scale), float(softcap or 1.0), float(mask_fill), float(dropout_p),
                    int(window), HAS_BIAS=has_bias, HAS_MASK=mask is not None, IS_CAUSAL=bool(is_causal),
                    WINDOW=window > 0, HAS_DROPOUT=dropout_p > 0, SOFTCAP=bool(softcap), PRECISION=launch_precision(q),
                    BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, num_warps=warps, num_stages=stages)
    return out, stats


def attention_backward_triton(dout, q, k, v, out, stats, bias, mask, mask_fill, is_causal, scale, dropout_p, seed,
                              bias_grad, softcap=0.0, window=0, kernels=("dq", "dkdv")):
    """dQ, dK, dV (and dBias where ``bias_grad``); ``kernels``: the launches made (a compile ahead makes one)."""
    (B, H, Sq, D), (Hkv, Sk) = q.shape, k.shape[1:3]
    dout, out = dout.contiguous(), out.contiguous()
    delta = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)   # rowsum(dO * O), by the dQ kernel
    dq = torch.empty((B, H, Sq, D), device=q.device, dtype=q.dtype)
    dk, dv = (torch.empty((B, Hkv, Sk, D), device=q.device, dtype=t.dtype) for t in (k, v))
    dbias = torch.empty((B, H, Sq, Sk), device=q.device, dtype=torch.float32) if bias_grad else q.new_empty(1)
    b, m, bs, ms, has_bias = bias_mask_args(q, k, bias, mask)
    key = bucket(q, k, bias, mask, is_causal, dropout_p, softcap, window)
    common = dict(HAS_BIAS=has_bias, HAS_MASK=mask is not None, IS_CAUSAL=bool(is_causal), WINDOW=window > 0,
                  HAS_DROPOUT=dropout_p > 0, SOFTCAP=bool(softcap), PRECISION=launch_precision(q))

    def tiles(kernel):   # each kernel its own configuration (configs.launch_cfg)
        BM, BN, BD, warps, stages = launch_cfg(q, D, key, kernel)
        return dict(BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, num_warps=warps, num_stages=stages)
    strides = (*q.stride(), *k.stride(), *v.stride(), *bs, *ms)
    seed_t = seed_arg(seed, q, dropout_p)
    t = tiles("dq")
    if "dq" in kernels:   # first: it writes delta, which the dK/dV kernel reads
        wrap_triton(_attn_bwd_dq)[(triton.cdiv(Sq, t["BLOCK_M"]), B * H)](
            q, k, v, b, m, dout, out, stats, delta, dq, dbias, seed_t, *strides,
            H, H // Hkv, Sq, Sk, D, float(scale), float(softcap or 1.0), float(mask_fill), float(dropout_p),
            int(window), BIAS_GRAD=bias_grad, **common, **t)
    t = tiles("dkdv")
    if "dkdv" in kernels:
        wrap_triton(_attn_bwd_dkdv)[(triton.cdiv(Sk, t["BLOCK_N"]), B * Hkv)](
            q, k, v, b, m, dout, stats, delta, dk, dv, seed_t, *strides,
            Hkv, H, H // Hkv, Sq, Sk, D, float(scale), float(softcap or 1.0), float(mask_fill), float(dropout_p),
            int(window), **common, **t)
    return dq, dk, dv, (dbias if bias_grad else None)
