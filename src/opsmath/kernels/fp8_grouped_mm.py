"""The grouped GEMM of a mixture-of-experts layer on FP8 tensor cores, rowwise dynamic scaling.

    y[r] = x[r] @ w[g]          for offs[g-1] <= r < offs[g]      (shapes and ``offs`` as in grouped_mm.py)

    forward:   s_x[r]    = amax_k |x[r, k]| / 448            a scale per row of x       (e4m3: largest 448)
               s_w[g, n] = amax_k |w[g, k, n]| / 448         a scale per output column of each expert
               y  = scaled_grouped_mm(e4m3(x / s_x), e4m3(w / s_w)) * s_x * s_w
    backward:  dx = scaled_grouped_mm(e4m3(dy' / s_dy), e4m3(w / s_w)^T) * s_dy,   dy'[r, n] = dy[r, n] s_w[g(r), n]
                    (the weight's scales vary along this GEMM's contraction: folded into dy, quantized per row)
               dw[g] = x_g^T dy_g   in bf16 (``torch._grouped_mm``): its contraction runs over each group's
                    rows, which FP8 grouped kernels take only with per-group column scales and group sizes
                    aligned to 16 rows; the routing makes groups of any size. Two of the three GEMMs run FP8.

Shapes: ``x`` [S, K], ``w`` [G, K, N] (any strides: the op lays each FP8 copy out as the kernel wants),
``offs`` [G] int32; K and N multiples of 16. Operands bf16, or fp32 (a grouped GEMM that eager runs in
fp32 under bf16 autocast: Hugging Face's grouped-mm fallback); outputs and gradients in the operands' dtypes.
The forward saves x in bf16 and the e4m3 weights (one byte per expert weight element) with their scales.

On CUDA the products are ``torch._scaled_grouped_mm`` (sm_90 and newer; the quantization is plain ATen
ops that Inductor fuses into the kernels producing x and dy); on the CPU ``opsmath::scaled_grouped_mm_cpu``
computes them as the GPU does up to summation order: dequantized operands multiplied in fp32, per group,
rounded to bf16 (the reference CI tests). Caveats: rows at or past ``offs[G-1]`` are undefined in ``y`` and
in ``dx`` on CUDA, as with ``torch._grouped_mm``: callers mask them (zeros on the CPU). FP8 is outside
docs/design.md's tolerance rule; a tensor slice whose amax is 0 gets scale 1.
"""
from __future__ import annotations

import torch

from opsmath.kernels._common import first_order_only
from opsmath.kernels._spec import OpSpec, backward, leaf, register
from opsmath.kernels.fp8_linear import E4M3, quantize
from opsmath.kernels.grouped_mm import _bounds, linear_layout, weight_grad


@torch.library.custom_op("opsmath::scaled_grouped_mm_cpu", mutates_args=())
def scaled_grouped_cpu(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor,
                       offs: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_grouped_mm``'s 2-D x 3-D product where PyTorch has no kernel (the CPU): ``aq`` [S, K]
    e4m3 with ``sa`` [S], ``bq`` [G, K, N] e4m3 with ``sb`` [G, N]; bf16 [S, N], zeros past the last group."""
    out = torch.zeros(aq.shape[0], bq.shape[2], dtype=torch.float32)
    for g, (s, e) in enumerate(_bounds(offs)):
        if e > s:
            out[s:e] = (aq[s:e].float() * sa[s:e, None]) @ (bq[g].float() * sb[g][None, :])
    return out.to(torch.bfloat16)


@scaled_grouped_cpu.register_fake
def _(aq, sa, bq, sb, offs):
    return aq.new_empty(aq.shape[0], bq.shape[2], dtype=torch.bfloat16)


def _gemm(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """bf16 ``(aq * sa) @ (bq[g] * sb[g])`` per group: ``aq`` [S, K] e4m3 row-major, ``sa`` [S]; ``bq``
    [G, K, N] e4m3 column-major per group (K contiguous: FP8 tensor cores read both operands K-major),
    ``sb`` [G, N]. Fast accumulation: the product alone measured 1.35-1.6x bf16's ``torch._grouped_mm`` on
    the H200 at 8 and 64 experts, where the exact accumulation ran 1.1-1.25x at 8 experts and 0.5x at 64
    (``benchmarks/results/grouped-gemm-fp8-requantized-weights-profile-20261204.log``)."""
    if aq.device.type != "cuda":
        return scaled_grouped_cpu(aq, sa, bq, sb, offs)
    with torch.autocast("cuda", enabled=False):
        return torch._scaled_grouped_mm(aq, bq, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)


def _row_groups(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's group (rows past the last group: the last group; callers zero them)."""
    at = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, at, right=True).clamp_(max=offs.shape[0] - 1)


class FP8GroupedMM(torch.autograd.Function):
    """Forward: x per row, w per (expert, output column) along K; the e4m3 weight ``wq`` [G, N, K] (K
    contiguous, as an ``nn.Linear`` stack stores it) is saved. Input gradient: ``dx = dy @ w^T`` contracts
    over N, where ``wq``'s scales vary, so they are folded into dy, ``dy'[r, n] = dy[r, n] * s_w[g(r), n]``,
    before dy' is quantized per row; the kernel then reads ``wq`` transposed (an e4m3 copy, N contiguous)
    with unit scales. No second quantization of the weights."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor):
        x16 = x.to(torch.bfloat16)
        xq, sx = quantize(x16, E4M3, -1)                                         # [S, K], [S, 1]
        wq, sw = quantize(w.to(torch.bfloat16).transpose(1, 2), E4M3, -1)       # [G, N, K], [G, N, 1]
        sw = sw.reshape(w.shape[0], w.shape[2])
        y = _gemm(xq.contiguous(), sx.reshape(-1), wq.contiguous().transpose(1, 2), sw, offs)
        ctx.save_for_backward(x16, wq.contiguous(), sw, offs)
        ctx.x_dtype, ctx.w_dtype, ctx.w_linear = x.dtype, w.dtype, linear_layout(w)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        first_order_only("fp8_experts")
        x16, wq, sw, offs = ctx.saved_tensors
        dy16, dx, dw = dy.to(torch.bfloat16), None, None
        if ctx.needs_input_grad[0]:
            gq, sg = quantize(dy16.float() * sw[_row_groups(offs, dy.shape[0])], E4M3, -1)
            wt = wq.transpose(1, 2).contiguous().transpose(1, 2)                 # [G, N, K], N contiguous
            ones = torch.ones(wq.shape[0], wq.shape[2], device=dy.device)
            dx = _gemm(gq, sg.reshape(-1), wt, ones, offs).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(x16, dy16, offs, ctx.w_linear).to(ctx.w_dtype)
        return dx, dw, None


def fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grouped_mm(x, w, offs)`` with FP8 GEMMs forward and for the input gradient (module docstring)."""
    if x.shape[1] % 16 or w.shape[2] % 16:
        raise ValueError(f"fp8_grouped_mm: K x N = {x.shape[1]} x {w.shape[2]}; FP8 GEMMs need multiples of 16")
    return FP8GroupedMM.apply(x, w, offs)


def reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The forward's quantization with fp32 products, zeros past the last group (what tests compare to)."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float32)
    xq, sx = quantize(x.to(torch.bfloat16), E4M3, -1)
    wq, sw = quantize(w.to(torch.bfloat16), E4M3, 1)
    for g, (s, e) in enumerate(_bounds(offs)):
        out[s:e] = (xq[s:e].float() * sx[s:e]) @ (wq[g].float() * sw[g])
    return out


def _exercise(dtype):
    backward(fp8_grouped_mm(leaf(6, 16, dtype=torch.bfloat16), leaf(2, 16, 32, dtype=torch.bfloat16),
                            torch.tensor([2, 6], dtype=torch.int32)))


SPEC = register(OpSpec("fp8_experts", ops=(fp8_grouped_mm,), exercise=_exercise, triton=False,
                       flops=lambda x, w, offs: 2.0 * x.shape[0] * x.shape[1] * w.shape[2],
                       saves="x in bf16 and the e4m3 expert weights with their scales"))
