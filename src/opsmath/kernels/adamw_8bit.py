"""AdamW with 8-bit moments: the step of ``src/opsmath/kernels/adamw.py`` with ``m`` and ``v`` stored block-wise
quantized, 2 bytes of state per parameter (plus 8 bytes per 256) instead of 8.

Storage, per parameter tensor, in blocks of ``QBLOCK`` = 256 consecutive elements (a last partial block
counts its own elements only)::

    m = a_m * (q_m / 127)^3      q_m: int8 in [-127, 127]     a_m = max |m| over the block (fp32)
    v = a_v * (q_v / 255)^4      q_v: uint8 in [0, 255]       a_v = max v over the block (fp32)

Power-law companding (cube for the signed first moment, fourth power for the non-negative second)
spends the codes geometrically: half a code step is a relative error of 1.5 / q (m) and 2 / q (v),
i.e. 1.2% / 0.8% at the block maximum, 5.5% / 2.5% at 1e-2 of it and 25% / 7.8% at 1e-4, about what
bitsandbytes' dynamic-exponent map gives, with two multiplies instead of a table search. The smallest
nonzero codes are a_m * 4.9e-7 and a_v * 2.3e-10; linear codes would flush most of a block to zero.
Encoding rounds to the nearest code in the companded domain, ``q = floor(127 * (|m| / a_m)^(1/3) +
0.5)`` (sign applied), ``q_v = floor(255 * (v / a_v)^(1/4) + 0.5)``, and a positive ``v`` never encodes to 0 (``q_v >= 1``): a zero second moment
under a nonzero first would make the update ``m / eps``.

One step, per block: decode m and v, run the AdamW update of ``src/opsmath/kernels/adamw.py`` in fp32 on the
decoded values (so the parameter update uses the exact new moments), then re-encode m and v with the
new block maxima. Quantization error therefore enters through the stored moments only, once per step.

Caveats: the companding exponents and the block size are fixed; a state_dict holds the codes and block
maxima (``opsmath.optim.AdamW`` converts to and from torch's fp32 layout on load).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opsmath.kernels._spec import OpSpec, register
from opsmath.kernels.adamw import (BLOCK, CHUNK, Gate, MultiTensor, addr, chunk_prologue, exercise_gate,
                                   exercise_tables, group_table, step_gate, tl_type)

QBLOCK = 256


# --------------------------------------------------------------------------------------------------
# Reference (torch ops, same operation order as the kernel)
# --------------------------------------------------------------------------------------------------


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """Flat ``x`` zero-padded to whole blocks, as (n_blocks, QBLOCK)."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % QBLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, QBLOCK)


def _root(r: torch.Tensor, k: float) -> torch.Tensor:
    """r^(1/k) for r >= 0 as the kernel computes it (exp2(log2(r) / k), 0 at 0)."""
    return torch.where(r > 0, torch.exp2(torch.log2(r.clamp_min(1e-30)) / k), torch.zeros_like(r))


def encode(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes shaped like ``x``, block maxima) of a moment tensor (fp32)."""
    b = _blocks(x.float())
    a = b.abs().amax(1)
    inv = torch.where(a > 0, 1.0 / a, torch.zeros_like(a))
    r = b.abs() * inv[:, None]
    if signed:
        q = torch.floor(_root(r, 3.0) * 127.0 + 0.5) * torch.sign(b)
        codes = q.to(torch.int8)
    else:
        q = torch.floor(torch.sqrt(torch.sqrt(r)) * 255.0 + 0.5)
        codes = torch.where(b > 0, q.clamp_min(1.0), q).to(torch.uint8)
    return codes.reshape(-1)[: x.numel()].view(x.shape), a


def decode(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """The fp32 moment that ``codes`` (int8: m, uint8: v) and their block maxima stand for."""
    c = _blocks(codes.to(torch.float32))
    if codes.dtype == torch.int8:
        x = c / 127.0
        y = absmax[:, None] * (x * x * x)
    else:
        x = c / 255.0
        x2 = x * x
        y = absmax[:, None] * (x2 * x2)
    return y.reshape(-1)[: codes.numel()].view(codes.shape)


def adamw8_reference(params, grads, m_codes, v_codes, m_max, v_max, masters, steps, lrs, wds, beta1, beta2, eps,
                     coef_scale, found_inf):
    """In place, per tensor; arguments as ``adamw_reference`` with the moments as (codes, maxima)."""
    if bool(found_inf):
        return
    for p, g, qm, qv, am, av, pm, t, lr, wd in zip(params, grads, m_codes, v_codes, m_max, v_max, masters,
                                                   steps, lrs, wds):
        w = pm if pm is not None else p.float()
        gf = g.float() * coef_scale.float()
        m = decode(qm, am) * beta1 + gf * (1.0 - beta1)
        v = decode(qv, av) * beta2 + gf * gf * (1.0 - beta2)
        step_size = lr / (1.0 - beta1 ** t)
        bc2_sqrt = (1.0 - beta2 ** t) ** 0.5
        w_new = w * (1.0 - lr * wd) - step_size * m / (torch.sqrt(v) / bc2_sqrt + eps)
        (pm if pm is not None else p).copy_(w_new)
        if pm is not None:
            p.copy_(w_new)
        for (codes, absmax), (nq, na) in zip(((qm, am), (qv, av)), (encode(m, True), encode(v, False))):
            codes.copy_(nq)
            absmax.copy_(na)


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


@triton.jit
def _root3(r):
    return tl.where(r > 0, tl.exp2(tl.log2(tl.maximum(r, 1e-30)) / 3.0), 0.0)


@triton.jit
def _adamw8_step(p_ptr, g_ptr, mq_ptr, vq_ptr, ms_ptr, vs_ptr, w_ptr, off, rem, MASKED: tl.constexpr,
                 coef, decay, step_size, bc2_sqrt, beta1, beta2, eps,
                 P_TY: tl.constexpr, HAS_MASTER: tl.constexpr, ROWS: tl.constexpr, QB: tl.constexpr):
    """ROWS quantization blocks starting at element ``off`` of the chunk."""
    r = tl.arange(0, ROWS)
    idx = off + r[:, None] * QB + tl.arange(0, QB)[None, :]
    blk = off // QB + r
    if MASKED:
        mask = idx < rem
        rmask = off + r * QB < rem
        other = 0.0
    else:
        mask = None
        rmask = None
        other = None
    g = tl.load(g_ptr + idx, mask=mask, other=other).to(tl.float32) * coef
    w = tl.load(w_ptr + idx, mask=mask, other=other).to(tl.float32) * decay
    xm = tl.load(mq_ptr + idx, mask=mask, other=other).to(tl.float32) / 127.0
    xv = tl.load(vq_ptr + idx, mask=mask, other=other).to(tl.float32) / 255.0
    am = tl.load(ms_ptr + blk, mask=rmask, other=other)
    av = tl.load(vs_ptr + blk, mask=rmask, other=other)
    xv2 = xv * xv
    m = am[:, None] * (xm * xm * xm) * beta1 + g * (1.0 - beta1)
    v = av[:, None] * (xv2 * xv2) * beta2 + g * g * (1.0 - beta2)
    w = w - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    am = tl.max(tl.abs(m), axis=1)
    av = tl.max(v, axis=1)
    rm = tl.abs(m) * tl.where(am > 0, 1.0 / am, 0.0)[:, None]
    rv = v * tl.where(av > 0, 1.0 / av, 0.0)[:, None]
    qm = tl.floor(_root3(rm) * 127.0 + 0.5)
    qm = tl.where(m < 0, -qm, qm)
    qv = tl.floor(tl.sqrt(tl.sqrt(rv)) * 255.0 + 0.5)
    qv = tl.where(v > 0, tl.maximum(qv, 1.0), qv)
    tl.store(mq_ptr + idx, qm.to(tl.int8), mask=mask)
    tl.store(vq_ptr + idx, qv.to(tl.uint8), mask=mask)
    tl.store(ms_ptr + blk, am, mask=rmask)
    tl.store(vs_ptr + blk, av, mask=rmask)
    if HAS_MASTER:
        tl.store(w_ptr + idx, w, mask=mask)
    tl.store(p_ptr + idx, w.to(P_TY, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _adamw8_kernel(P_PTRS, G_PTRS, MQ_PTRS, VQ_PTRS, MS_PTRS, VS_PTRS, W_PTRS, STEP_PTRS, SIZES, GROUP, LRS, WDS,
                   CHUNK_TENSOR, CHUNK_START, SUMSQ, SCALE, FOUND, NORM_OUT, INC_OUT, max_norm, beta1, beta2, eps,
                   P_TY: tl.constexpr, G_TY: tl.constexpr, HAS_MASTER: tl.constexpr, CLIP: tl.constexpr,
                   SKIP_NONFINITE: tl.constexpr, ALIGNED: tl.constexpr, CHUNK_SIZE: tl.constexpr,
                   BLOCK: tl.constexpr, QB: tl.constexpr):
    skip, coef = step_gate(SUMSQ, SCALE, FOUND, NORM_OUT, INC_OUT, max_norm, CLIP, SKIP_NONFINITE)
    if not skip:
        i, start, rem, step_size, bc2_sqrt, decay, p_ptr, g_ptr, w_ptr = chunk_prologue(
            CHUNK_TENSOR, CHUNK_START, SIZES, STEP_PTRS, GROUP, LRS, WDS, P_PTRS, G_PTRS, W_PTRS, beta1, beta2,
            P_TY, G_TY, HAS_MASTER, ALIGNED, CHUNK_SIZE, BLOCK)
        mq_ptr = addr(MQ_PTRS, i, tl.int8, ALIGNED) + start
        vq_ptr = addr(VQ_PTRS, i, tl.uint8, ALIGNED) + start
        ms_ptr = addr(MS_PTRS, i, tl.float32, ALIGNED) + start // QB
        vs_ptr = addr(VS_PTRS, i, tl.float32, ALIGNED) + start // QB
        full = rem // BLOCK * BLOCK
        for off in range(0, full, BLOCK):
            _adamw8_step(p_ptr, g_ptr, mq_ptr, vq_ptr, ms_ptr, vs_ptr, w_ptr, off, rem, False, coef, decay,
                         step_size, bc2_sqrt, beta1, beta2, eps, P_TY, HAS_MASTER, BLOCK // QB, QB)
        _adamw8_step(p_ptr, g_ptr, mq_ptr, vq_ptr, ms_ptr, vs_ptr, w_ptr, full, rem, True, coef, decay,
                     step_size, bc2_sqrt, beta1, beta2, eps, P_TY, HAS_MASTER, BLOCK // QB, QB)


def adamw8_triton(tables: MultiTensor, grads, lrs, wds, beta1, beta2, eps, gate: Gate, dtypes) -> None:
    """The 8-bit update over ``tables.keep`` = [params, m codes, v codes, steps, m maxima, v maxima]
    (+ [masters]); other arguments as ``kernels.adamw.adamw_triton``."""
    gptrs, galigned = tables.grads(grads)
    st = tables.static
    has_master = len(st) == 7
    _adamw8_kernel[(tables.n_chunks,)](
        st[0], gptrs, st[1], st[2], st[4], st[5], st[6] if has_master else st[0], st[3], tables.sizes,
        tables.group, lrs, wds, tables.chunk_tensor, tables.chunk_start, *gate.args(), float(beta1), float(beta2),
        float(eps), P_TY=tl_type(dtypes[0]), G_TY=tl_type(dtypes[1]), HAS_MASTER=has_master,
        CLIP=gate.sumsq is not None, SKIP_NONFINITE=gate.skip_nonfinite,
        ALIGNED=galigned and tables.static_aligned, CHUNK_SIZE=CHUNK, BLOCK=BLOCK, QB=QBLOCK, num_warps=4)


def new_state(p: torch.Tensor) -> dict:
    """Zero 8-bit moments for parameter ``p``: codes shaped like ``p``, fp32 maxima per block."""
    nb = (p.numel() + QBLOCK - 1) // QBLOCK
    z = dict(device=p.device)
    return dict(exp_avg_q=torch.zeros(p.shape, dtype=torch.int8, **z),
                exp_avg_sq_q=torch.zeros(p.shape, dtype=torch.uint8, **z),
                exp_avg_max=torch.zeros(nb, dtype=torch.float32, **z),
                exp_avg_sq_max=torch.zeros(nb, dtype=torch.float32, **z))


def _exercise(dtype: torch.dtype) -> None:
    for master in (False, True):
        tables, grads = exercise_tables(dtype, torch.float32, master)
        params, steps = tables.keep[0], tables.keep[3]
        st = [new_state(p) for p in params]
        static = [params, [s["exp_avg_q"] for s in st], [s["exp_avg_sq_q"] for s in st], steps,
                  [s["exp_avg_max"] for s in st], [s["exp_avg_sq_max"] for s in st]] + tables.keep[4:]
        tables = MultiTensor([p.numel() for p in params], static, [0] * len(params), params[0].device)
        adamw8_triton(tables, grads, group_table([1e-3], tables.device), group_table([0.01], tables.device),
                      0.9, 0.999, 1e-8, exercise_gate(grads if master else None), (dtype, dtype))


SPEC = register(OpSpec("adamw_8bit", exercise=_exercise))
