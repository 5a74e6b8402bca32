"""One fused cast of many weights to FP8 e4m3 with a dynamic scale per tensor: what ``fp8_linear``'s
forward would compute for each weight, for all of them in three launches (zero the amaxes, one
multi-tensor amax, one multi-tensor cast), so that a model's FP8 weight copies are made once per
optimizer step rather than in every forward (``opsmath.runtime.fp8_weights`` decides when).

Math, per weight ``W`` (fp32 master or bf16; cast to bf16 first, as the linear's input cast does)::

    a = amax |bf16(W)|                       (pass 1: per chunk, ``atomic_max`` into the tensor's slot)
    s = a * fp32(1 / 448), or 1 where a == 0  (e4m3's largest finite value: 448)
    Q = e4m3(clamp(bf16(W) / s, -448, 448))   (pass 2: round to nearest even, as ``Tensor.to``)

bit for bit ``kernels.fp8_linear.quantize(bf16(W), e4m3)``: the division is IEEE (``div_rn``), the scale
a product by the fp32 reciprocal (as PyTorch's CUDA kernels divide by a Python scalar), and the rounding
to e4m3's grid is done in fp32 arithmetic (exact; the conversion then only stores), so the result does
not depend on how a backend converts to FP8 (Triton's CPU interpreter does not round to nearest). Chunks and address tables are ``kernels.adamw``'s multi-tensor plumbing.

Shapes: any contiguous weights, ``Q`` of the same shape in ``float8_e4m3fn``, ``s`` 0-d fp32. Caveat: a
weight holding NaN gets a finite scale from the others (torch's amax would give NaN); its NaNs stay
NaN in ``Q``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opsmath.kernels._spec import OpSpec, register
from opsmath.kernels.adamw import BLOCK, CHUNK, MultiTensor, addr, aligned, chunk_of, tl_type
from opsmath.kernels.fp8_linear import E4M3, quantize

E4M3_MAX = 448.0


def cast_weights_reference(weights: list[torch.Tensor], qs: list[torch.Tensor], scales: list[torch.Tensor]) -> None:
    """In place: ``qs[i], scales[i] = quantize(bf16(weights[i]), e4m3)``, written through ``.data`` so a
    refresh does not bump the versions autograd checks on tensors an earlier forward saved (the values
    are the same unless the weight changed, and a weight must not change between forward and backward)."""
    with torch.no_grad():
        for w, q, s in zip(weights, qs, scales):
            wq, sw = quantize(w.detach().to(torch.bfloat16), E4M3)
            q.data.copy_(wq)
            s.data.copy_(sw)


@triton.jit
def _load_bf16(w_ptr, idx, rem, W_TY: tl.constexpr):
    """The weights at ``idx`` rounded to bf16 (nearest, ties to even; NaN kept), as fp32 values."""
    w = tl.load(w_ptr + idx, mask=idx < rem, other=0.0).to(tl.float32)
    if W_TY != tl.bfloat16:
        b = w.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536     # -65536: 0xFFFF0000
        w = tl.where(w != w, w, b.to(tl.float32, bitcast=True))
    return w


@triton.jit
def _amax_kernel(W_PTRS, SIZES, CHUNK_TENSOR, CHUNK_START, AMAX, W_TY: tl.constexpr, ALIGNED: tl.constexpr,
                 CHUNK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    i, start, rem = chunk_of(CHUNK_TENSOR, CHUNK_START, SIZES, CHUNK_SIZE, BLOCK)
    w_ptr = addr(W_PTRS, i, W_TY, ALIGNED) + start
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, rem, BLOCK):
        acc = tl.maximum(acc, tl.abs(_load_bf16(w_ptr, off + tl.arange(0, BLOCK), rem, W_TY)))
    tl.atomic_max(AMAX + i, tl.max(acc, 0))


@triton.jit
def _round_e4m3(v):
    """``v`` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32, sign (and -0) kept:
    the grid step is 2^(e - 3) for the binade 2^e, and 2^-9 below 2^-6 (subnormals); adding and
    subtracting 1.5 * 2^23 rounds a step count below 2^22 to an integer, ties to even."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    k = tl.maximum(((bits >> 23) & 0xFF) - 127 - 3, -9)            # the grid step is 2^k
    ulp = ((k + 127) << 23).to(tl.float32, bitcast=True)
    n = a * ((127 - k) << 23).to(tl.float32, bitcast=True)         # a / 2^k, exact (no division)
    n = (n + 12582912.0) - 12582912.0  # 1.5 * 2^23
    r = (n * ulp).to(tl.int32, bitcast=True) | (bits & -2147483648)   # the sign bit
    return tl.where(v != v, v, r.to(tl.float32, bitcast=True))


@triton.jit
def _cast_kernel(W_PTRS, Q_PTRS, S_PTRS, SIZES, CHUNK_TENSOR, CHUNK_START, AMAX, W_TY: tl.constexpr,
                 ALIGNED: tl.constexpr, CHUNK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    i, start, rem = chunk_of(CHUNK_TENSOR, CHUNK_START, SIZES, CHUNK_SIZE, BLOCK)
    amax = tl.load(AMAX + i)
    scale = tl.where(amax > 0, amax * (1.0 / 448.0), 1.0)
    w_ptr = addr(W_PTRS, i, W_TY, ALIGNED) + start
    q_ptr = addr(Q_PTRS, i, tl.float8e4nv, ALIGNED) + start
    for off in range(0, rem, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        v = tl.clamp(tl.div_rn(_load_bf16(w_ptr, idx, rem, W_TY), scale), -448.0, 448.0)
        tl.store(q_ptr + idx, _round_e4m3(v).to(tl.float8e4nv), mask=idx < rem)
    if start == 0:
        tl.store(addr(S_PTRS, i, tl.float32, False), scale)


class CastTables:
    """Launch tables of one fixed list of (weight, FP8 copy, scale). They hold addresses, not the tensors:
    whoever launches them keeps the tensors alive through the launch and must know those addresses still
    are the tensors' (``fp8_weights`` keys its tables by them)."""

    def __init__(self, weights: list[torch.Tensor], qs: list[torch.Tensor], scales: list[torch.Tensor]):
        assert len({w.dtype for w in weights}) == 1, "one weight dtype per table"
        self.dtype = weights[0].dtype
        self.tables = MultiTensor([w.numel() for w in weights], [weights, qs, scales], [0] * len(weights),
                                  weights[0].device)
        self.tables.keep = None   # a weight passed for one call only (functional_call) must not live on
        self.aligned = aligned(weights) and aligned(qs)
        self.amax = torch.zeros(len(weights), dtype=torch.float32, device=weights[0].device)


def cast_weights_triton(t: CastTables) -> None:
    """The fused cast of every weight in ``t`` into its FP8 copy and scale (module docstring)."""
    tab = t.tables
    t.amax.zero_()
    args = (tab.sizes, tab.chunk_tensor, tab.chunk_start, t.amax)
    meta = dict(W_TY=tl_type(t.dtype), ALIGNED=t.aligned, CHUNK_SIZE=CHUNK, BLOCK=BLOCK, num_warps=4)
    _amax_kernel[(tab.n_chunks,)](tab.static[0], *args, **meta)
    _cast_kernel[(tab.n_chunks,)](*tab.static, *args, **meta)


def _exercise(dtype: torch.dtype) -> None:
    weights = [torch.randn(n, 48, dtype=dtype) for n in (16, 400)]
    qs = [torch.empty(w.shape, dtype=E4M3) for w in weights]
    scales = [torch.ones(()) for _ in weights]     # alive through the launch: the tables hold addresses only
    cast_weights_triton(CastTables(weights, qs, scales))


# the FP8 weight copies of ``fp8_linear`` (``opsmath.runtime.fp8_weights``), not a rewrite family of its own
SPEC = register(OpSpec("fp8_weight_cast", exercise=_exercise))
