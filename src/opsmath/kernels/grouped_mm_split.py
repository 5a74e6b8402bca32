"""fp32 grouped GEMMs on TF32 tensor cores with one operand split ahead: ``opsmath::grouped_mm``'s
fp32 path where cuBLAS would run fp32 (``grouped_mm.precision`` is ``tf32x3``).

Math: every fp32 ``v`` is ``hi + lo`` with ``hi = tf32(v)`` (round to nearest, 10 mantissa bits) and
``lo = tf32(v - hi)``, and each product is taken as three TF32 products in fp32 accumulation::

    a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi       (a_lo b_lo, about 2^-22 of a b, dropped)

Triton's ``input_precision="tf32x3"`` computes the same sum but splits both operands inside every tile,
which on sm_90 sends each split tile back through shared memory before its ``wgmma`` (45 TFLOP/s on an
H100). Here the token-side operand is split ahead, in row chunks, by ``_grouped_split_rows`` into two fp32
arrays laid out K-major (``hi``, ``lo``: [rows, C] row-major for the forward and input gradient, [C, rows] for the
weight gradient), which the GEMM reads straight into shared memory as ``wgmma``'s B operand; the other
operand (a weight tile, or ``x^T`` in the weight gradient) is split in registers, ``wgmma``'s A operand.

Shapes and layouts as ``grouped_mm.py``: rows sorted by group, ``offs`` [G] int32 running ends, weights
[G, K, N] with any strides. The forward and input-gradient kernel computes each tile transposed
(``acc^T = w[g]^T x^T``) and stores it back as ``y``'s rows.

Memory: the split chunk is two arrays of at most ``SPLIT_BYTES`` each (the GEMM's only transient); rows
run in chunks of as many as fit (a multiple of 128), the weight gradient adding each chunk after the first
into its output (``ACCUM``; programs whose group has no row in a chunk return at once). Rows in no group
(past ``offs[G-1]``) are zeros in the output and add nothing to the weight gradient.

Caveats: ``hi`` of a value within half a TF32 ulp of fp32's largest rounds to inf (as ``cvt.rna.tf32``
does); the CPU (Triton's interpreter) computes the TF32 products in fp32, so CPU tests check the
indexing and the split, GPU tests the tolerance rule (``tests/test_kernel_grouped_mm.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opsmath.kernels._common import next_pow2, tuned_config

SPLIT_BYTES = 32 << 20        # bytes of each of the two split arrays (hi, lo) of one chunk of rows
# (BM rows, BN weight columns, BK inner, warps, stages): forward / input gradient (the tile computed as
# [BN, BM]); weight gradient: BM rows a step, a [BK, BN] tile of the output. A tile holds two fp32
# accumulators (the running sum and the tile's partial): compiled for sm_90 by Triton 3.6, none of these
# spills registers (ptxas -v: 138-255 a thread), where 64x128x128w8s2 and 32x128x64w4s4 would.
FWD_TILES = {"128x128x32w8s3": (128, 128, 32, 8, 3), "128x128x32w8s4": (128, 128, 32, 8, 4),
             "64x128x32w4s4": (64, 128, 32, 4, 4), "128x64x32w4s4": (128, 64, 32, 4, 4)}
WGRAD_TILES = {"32x128x128w8s3": (32, 128, 128, 8, 3), "32x128x128w8s4": (32, 128, 128, 8, 4),
               "16x128x128w8s4": (16, 128, 128, 8, 4), "32x64x128w8s4": (32, 64, 128, 8, 4)}


@triton.jit
def _tf32(v):
    """``v`` rounded to TF32 (nearest, ties away from zero), as fp32."""
    return ((v.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _grouped_split_rows(X, HI, LO, R0, R, C, sxr, sxc, shr, shc, BR: tl.constexpr, BC: tl.constexpr):
    """``HI[r, c], LO[r, c] = tf32(v), tf32(v - tf32(v))`` for ``v = X[R0 + r, c]``, ``r < R``; HI and LO
    share strides (``shr``, ``shc``): row-major or transposed."""
    rs = tl.program_id(0) * BR + tl.arange(0, BR)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (rs[:, None] < R) & (cs[None, :] < C)
    v = tl.load(X + (R0 + rs[:, None]).to(tl.int64) * sxr + cs[None, :] * sxc, mask=m, other=0.0)
    hi = _tf32(v)
    at = rs[:, None].to(tl.int64) * shr + cs[None, :].to(tl.int64) * shc
    tl.store(HI + at, hi, mask=m)
    tl.store(LO + at, _tf32(v - hi), mask=m)


@triton.jit
def _dot3(a, b_hi, b_lo, acc):
    """``acc + a b`` as three TF32 products, ``a`` split here (module docstring). The tile's products are
    summed from zero on the tensor cores, small terms first, and added to ``acc`` in an fp32 add (as
    Triton's ``tf32x3`` does): chained into ``acc`` over all of K, the tensor cores' accumulation lost
    bits at every step and failed the tolerance rule at K = 1024 on an H100."""
    a_hi = _tf32(a)
    part = tl.dot(_tf32(a - a_hi), b_hi, input_precision="tf32")
    part = tl.dot(a_hi, b_lo, part, input_precision="tf32")
    return acc + tl.dot(a_hi, b_hi, part, input_precision="tf32")


@triton.jit
def _swizzled(pid, rows, cols, GROUP: tl.constexpr):
    """Program ``pid`` of a ``rows x cols`` grid as (row, col), ``GROUP`` rows at a time with the row
    fastest (the Triton matmul tutorial's order): programs running together share a few row blocks and a
    few column blocks, which L2 keeps, instead of reading every row block once per column block."""
    width = GROUP * cols
    first = (pid // width) * GROUP
    size = tl.minimum(rows - first, GROUP)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit
def group_of_tile(Offs, pid, G, R0, R1, BM: tl.constexpr, GP: tl.constexpr):
    """(group, its end row, the tile's first row) of row tile ``pid`` over rows ``[R0, R1)``, group ``G``
    past the last tile: tiles of ``BM`` rows laid out group after group, each group's rows clipped to the
    range (the whole of ``offs`` for ``R0 = 0``, ``R1 = 2^31 - 1``: ``grouped_mm``'s kernels)."""
    gs = tl.arange(0, GP)
    last = tl.minimum(tl.maximum(tl.load(Offs + G - 1), R0), R1)
    ends = tl.where(gs < G, tl.minimum(tl.maximum(tl.load(Offs + gs, mask=gs < G, other=0), R0), R1), last)
    starts = tl.load(Offs + gs - 1, mask=(gs >= 1) & (gs < G), other=0)
    starts = tl.where(gs < G, tl.minimum(tl.maximum(starts, R0), R1), last)
    tiles = (ends - starts + BM - 1) // BM
    before = tl.cumsum(tiles, 0) - tiles                       # tiles of the groups before each
    g = tl.sum(((before + tiles) <= pid).to(tl.int32), 0)       # the first group whose tiles reach past pid
    pick = gs == g
    start, end = tl.sum(tl.where(pick, starts, 0), 0), tl.sum(tl.where(pick, ends, 0), 0)
    return g, end, start + (pid - tl.sum(tl.where(pick, before, 0), 0)) * BM


@triton.jit
def _grouped_fwd_split(HI, LO, W, Offs, Y, K, N, G, R0, R1, T, swg, swk, swn, sym, syn,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GP: tl.constexpr):
    """``Y[r] = X[r] @ W[g]`` for one row tile of the chunk ``[R0, R1)`` (of at most ``T``) and ``BN`` output
    columns, from the chunk's split rows (``HI``, ``LO``: [R1 - R0, K] row-major); computed as ``W[g]^T X^T``."""
    tile, nb = _swizzled(tl.program_id(0), T, tl.cdiv(N, BN), 8)
    g, end, row0 = group_of_tile(Offs, tile, G, R0, R1, BM, GP)
    if g < G:
        rows, cols = row0 + tl.arange(0, BM), nb * BN + tl.arange(0, BN)
        rmask, cmask = rows < end, cols < N
        local = (rows - R0).to(tl.int64)
        acc = tl.zeros([BN, BM], tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < K
            w = tl.load(W + g.to(tl.int64) * swg + cols[:, None] * swn + ks[None, :] * swk,
                        mask=cmask[:, None] & kmask[None, :], other=0.0)
            at = local[None, :] * K + ks[:, None]
            bm = kmask[:, None] & rmask[None, :]
            acc = _dot3(w, tl.load(HI + at, mask=bm, other=0.0), tl.load(LO + at, mask=bm, other=0.0), acc)
        tl.store(Y + rows[None, :].to(tl.int64) * sym + cols[:, None] * syn, acc, mask=rmask[None, :] & cmask[:, None])


@triton.jit
def _grouped_wgrad_split(A, HI, LO, Offs, DW, K, N, R0, R1, sam, sak, swg, swk, swn, ACCUM: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``DW[g] (+)= A_g^T B_g`` over the group's rows in ``[R0, R1)``, one [BK, BN] tile; ``B``'s rows split
    ahead and transposed (``HI``, ``LO``: [N, R1 - R0]); ``ACCUM``: add to what ``DW`` holds."""
    KB = tl.cdiv(K, BK)   # the groups one after the other, each group's tiles in ``_swizzled`` order
    g, pid = tl.program_id(0) // (KB * tl.cdiv(N, BN)), tl.program_id(0) % (KB * tl.cdiv(N, BN))
    kb, nb = _swizzled(pid, KB, tl.cdiv(N, BN), 8)
    start = tl.minimum(tl.maximum(tl.load(Offs + g - 1, mask=g > 0, other=0), R0), R1)
    end = tl.minimum(tl.maximum(tl.load(Offs + g), R0), R1)
    ks, cols = kb * BK + tl.arange(0, BK), nb * BN + tl.arange(0, BN)
    if ACCUM:   # a group with no row in this chunk neither reads nor writes its tile
        K = tl.where(end > start, K, 0)
    kmask, cmask = ks < K, cols < N
    out = DW + g.to(tl.int64) * swg + ks[:, None] * swk + cols[None, :] * swn
    valid = kmask[:, None] & cmask[None, :]
    acc = tl.zeros([BK, BN], tl.float32)
    if ACCUM:
        acc = tl.load(out, mask=valid, other=0.0)
    span = R1 - R0
    for m0 in range(start, end, BM):
        rows = m0 + tl.arange(0, BM)
        rmask = rows < end
        a = tl.load(A + rows[None, :].to(tl.int64) * sam + ks[:, None] * sak, mask=kmask[:, None] & rmask[None, :],
                    other=0.0)
        at = cols[None, :].to(tl.int64) * span + (rows - R0)[:, None]
        bm = rmask[:, None] & cmask[None, :]
        acc = _dot3(a, tl.load(HI + at, mask=bm, other=0.0), tl.load(LO + at, mask=bm, other=0.0), acc)
    tl.store(out, acc, mask=valid)


def chunk_rows(rows: int, cols: int) -> int:
    """Rows of one split chunk: as many as ``SPLIT_BYTES`` holds at ``cols`` fp32 columns, a multiple of
    128 (at least 128), at most ``rows``."""
    return max(1, min(rows, max(128, (SPLIT_BYTES // (4 * max(1, cols))) // 128 * 128)))


def split_rows(x: torch.Tensor, r0: int, r1: int, hi: torch.Tensor, lo: torch.Tensor, transposed: bool) -> None:
    """Write ``tf32`` hi and lo of ``x[r0:r1]`` ([rows, C] fp32, any strides) into ``hi``/``lo``: [rows, C]
    row-major, or ``transposed`` [C, rows]."""
    R, C = r1 - r0, x.shape[1]
    strides = (1, R) if transposed else (C, 1)
    _grouped_split_rows[(triton.cdiv(R, 64), triton.cdiv(C, 64))](x, hi, lo, r0, R, C, *x.stride(), *strides,
                                                                   BR=64, BC=64)


def workspace(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> int:
    """Bytes the split chunk takes while the forward runs (``hi`` and ``lo``); 0 where the op runs otherwise."""
    return 2 * 4 * chunk_rows(x.shape[0], x.shape[1]) * x.shape[1]


def shared_fits(tile, wgrad: bool, x: torch.Tensor) -> bool:
    """Whether a tile's pipelined operands (the register-split tile, the split ones twice) fit one block's
    shared memory on ``x``'s GPU (always on the CPU)."""
    if not x.is_cuda:
        return True
    limit = getattr(torch.cuda.get_device_properties(x.device), "shared_memory_per_block_optin", 232448)
    bm, bn, bk, _, stages = tile
    per_stage = (bk * bm + 2 * bm * bn) if wgrad else (bn * bk + 2 * bk * bm)
    return per_stage * 4 * stages <= limit


def _pick(op: str, tiles: dict, x: torch.Tensor, G: int, K: int, N: int, run):
    fits = {k: t for k, t in tiles.items() if shared_fits(t, op.endswith("wgrad"), x)} or tiles
    key = f"split G={G} K={K} N={N} rows<={next_pow2(x.shape[0])}"
    return tuned_config(op, key, fits, run, x.device)


def _over_chunks(S: int, step: int, split, run, pick) -> None:
    """For each chunk ``[r0, r1)`` of ``S`` rows, ``step`` at a time: ``split(r0, r1)`` into the chunk's
    buffers, then ``run(tile, r0, r1)``, the tile chosen once by ``pick`` from launches of the first chunk
    (which overwrite their output: no ``ACCUM``)."""
    tile = None
    for r0 in range(0, S, step):
        r1 = min(S, r0 + step)
        split(r0, r1)
        tile = tile or pick(lambda t, r0=r0, r1=r1: run(t, r0, r1))
        run(tile, r0, r1)


def forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, step: int = 0) -> torch.Tensor:
    """``y[r] = x[r] @ w[g]`` for fp32 ``x`` [S, K], ``w`` [G, K, N] (any strides); zeros past the last
    group; no host read of ``offs``. ``step``: rows a chunk (``chunk_rows`` when 0)."""
    (S, K), G, N = x.shape, w.shape[0], w.shape[2]
    y = x.new_zeros(S, N)
    if not (S and N and K):
        return y
    step = step or chunk_rows(S, K)
    hi, lo = x.new_empty(step, K), x.new_empty(step, K)

    def run(t, r0, r1):
        bm, bn, bk, warps, stages = t
        tiles = triton.cdiv(r1 - r0, bm) + G
        _grouped_fwd_split[(tiles * triton.cdiv(N, bn),)](
            hi, lo, w, offs, y, K, N, G, r0, r1, tiles, *w.stride(), *y.stride(), BM=bm, BN=bn, BK=bk,
            GP=max(16, triton.next_power_of_2(G)), num_warps=warps, num_stages=stages)
    _over_chunks(S, step, lambda r0, r1: split_rows(x, r0, r1, hi, lo, transposed=False), run,
                 lambda chunk0: _pick("grouped_mm_split_fwd", FWD_TILES, x, G, K, N, chunk0))
    return y


def weight_grad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, step: int = 0) -> torch.Tensor:
    """``dw[g] = a_g^T b_g`` ([G, K, N] fp32) for ``a`` [S, K], ``b`` [S, N]; zero for an empty group.
    ``step``: rows a chunk (``chunk_rows`` when 0)."""
    G, (S, K), N = offs.shape[0], a.shape, b.shape[1]
    dw = a.new_empty(G, K, N)
    if not (G and K and N):
        return dw
    if S == 0:
        return dw.zero_()
    step = step or chunk_rows(S, N)
    hi, lo = a.new_empty(N * step), a.new_empty(N * step)

    def run(t, r0, r1):
        bm, bn, bk, warps, stages = t
        _grouped_wgrad_split[(G * triton.cdiv(K, bk) * triton.cdiv(N, bn),)](
            a, hi, lo, offs, dw, K, N, r0, r1, *a.stride(), *dw.stride(), ACCUM=r0 > 0, BM=bm, BN=bn, BK=bk,
            num_warps=warps, num_stages=stages)
    _over_chunks(S, step, lambda r0, r1: split_rows(b, r0, r1, hi, lo, transposed=True), run,
                 lambda chunk0: _pick("grouped_mm_split_wgrad", WGRAD_TILES, a, G, K, N, chunk0))
    return dw
