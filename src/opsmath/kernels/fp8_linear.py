"""A linear layer on FP8 tensor cores: ``y = x @ W^T (+ b)`` with both GEMM operands in FP8 and both
backward GEMMs in FP8, dynamic scaling per tensor (default) or per row.

    forward:   s_x = amax|x| / 448,  s_w = amax|W| / 448              (e4m3: largest finite 448)
               y   = scaled_mm(e4m3(x / s_x), e4m3(W / s_w)^T) * s_x * s_w        [M, K] x [K, N]
    backward:  s_g = amax|dy| / 57344                                 (e5m2: largest finite 57344)
               dx  = scaled_mm(e5m2(dy / s_g), e4m3 W) * s_g * s_w               [M, N] x [N, K]
               dW  = scaled_mm(e5m2(dy / s_g)^T, e4m3 x) * s_g * s_x             [N, M] x [M, K]
               db  = sum_rows dy (bf16, exact as eager)

Rowwise (``rowwise=True``, torchao's rowwise recipe): one scale per row of each GEMM operand along its
contraction dim, e4m3 everywhere (gradients too; the e4m3 range suffices once each row has its own scale):

    forward:   y  = scaled_mm(e4m3 x [s per row of x], e4m3 W^T [s per row of W])       scales (M,1), (1,N)
    backward:  dx = scaled_mm(e4m3 dy [per row], e4m3 W [per column of W])             (M,1), (1,K)
               dW = scaled_mm(e4m3 dy^T [per column of dy], e4m3 x [per column of x])   (N,1), (1,K)

so x, W and dy are each quantized twice, along both dims; the forward saves x's column-quantized copy.

Shapes: ``x`` [..., K], ``W`` [N, K], ``b`` [N]; K and N multiples of 16 (``torch._scaled_mm``). The
forward saves the FP8 copies of x and W (half of bf16) and the two scales. The casts and amax
reductions are plain ATen ops: under Inductor (``opsmath.optimize`` on CUDA) AOTAutograd traces through
this ``autograd.Function`` and fuses them into the kernels that produce x and dy.

A tensorwise weight's cast can be made ahead, once per optimizer step for many weights (``fp8_cast``),
and passed as ``wq, sw``: the op then reads ``w`` only to give it its gradient.

Caveats: FP8 is not within docs/design.md's tolerance rule; its numerics are judged by loss curves
(BENCHMARKS.md). A tensor whose amax is 0 gets scale 1 (all zeros stay zeros). Overflow cannot happen
with dynamic scaling; values below the smallest subnormal flush to zero (counted by ``underflow``).
Runs on CPU too (PyTorch's CPU ``_scaled_mm``): the reference path CI tests.
"""
from __future__ import annotations

import torch

from opsmath.kernels._common import first_order_only
from opsmath.kernels._spec import OpSpec, backward, leaf, register

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def quantize(t: torch.Tensor, dtype: torch.dtype, dim=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t / s) as dtype, s``: fp32 scales mapping amax to the format's largest value, one for the tensor
    (``dim=None``) or one per slice reduced over ``dim`` (kept as a size-1 dim: ``dim=-1`` gives a scale per
    row, shape (rows, 1))."""
    amax = (t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True)).float()
    scale = torch.where(amax > 0, amax * (1.0 / MAX[dtype]), torch.ones_like(amax))   # as CUDA divides by a scalar
    return (t.float() / scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype), scale


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, **kw) -> torch.Tensor:
    """``torch._scaled_mm`` outside autocast: PyTorch's CPU kernel multiplies the dequantized operands with
    an ATen matmul that an enclosing autocast would run in bf16 (measured: max error 0.107 against the
    fp32 product where it is 0.062 outside autocast), and a selective checkpoint region, which runs its
    ops below autocast, then gave another forward than the same graph without one.

    On CPU the product is computed here as that kernel computes it, ``(a * scale_a) @ (b * scale_b)`` in
    fp32 then cast to ``out_dtype``: the CPU kernel of torch 2.11 and older takes only per-tensor scales
    and fails on rowwise ones."""
    with torch.autocast(a.device.type, enabled=False):
        if a.device.type == "cpu":
            out = (a.float() * kw["scale_a"]) @ (b.float() * kw["scale_b"])
            return out.to(kw.get("out_dtype") or torch.float32)
        return torch._scaled_mm(a, b, **kw)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (what ``_scaled_mm`` wants for its second operand)."""
    return t.t().contiguous().t()


def _token_padded(t: torch.Tensor) -> torch.Tensor:
    """An FP8 (tokens, features) operand of dW = gᵀ x with zero rows appended up to a multiple of 16 tokens:
    ``_scaled_mm`` on CUDA wants its inner dimension a multiple of 16, and the token count (batch x
    sequence) is whatever the batch is; a zero row adds nothing to the sum. (Byte 0 is +0 in e4m3 and e5m2.)"""
    pad = -t.shape[0] % 16
    return torch.nn.functional.pad(t.view(torch.uint8), (0, 0, 0, pad)).view(t.dtype) if pad else t


class FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b, rowwise: bool = False, wq=None, sw=None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if rowwise:
            xq, sx = quantize(x2, E4M3, -1)
            wq, sw = quantize(w, E4M3, -1)
            y = _scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.reshape(1, -1), out_dtype=x.dtype)
            xq, sx = quantize(x2, E4M3, 0)          # what dW needs: a scale per column of x
            ctx.save_for_backward(xq, sx, w)
        else:
            xq, sx = quantize(x2, E4M3)
            if wq is None:
                wq, sw = quantize(w, E4M3)
            y = _scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)
            ctx.save_for_backward(xq, sx, wq, sw)
        if b is not None:
            y = y + b
        ctx.shape, ctx.has_bias, ctx.dtype, ctx.rowwise, ctx.w_dtype = shape, b is not None, x.dtype, rowwise, w.dtype
        return y.reshape(*shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        first_order_only("fp8_linear")
        g = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.rowwise:
            xq, sx, w = ctx.saved_tensors
            if ctx.needs_input_grad[0]:
                gq, sg = quantize(g, E4M3, -1)
                wq, sw = quantize(w, E4M3, 0)
                dx = _scaled_mm(gq, _col_major(wq), scale_a=sg, scale_b=sw, out_dtype=ctx.dtype)
            if ctx.needs_input_grad[1]:
                gq, sg = quantize(g, E4M3, 0)
                dw = _scaled_mm(_token_padded(gq).t().contiguous(), _col_major(_token_padded(xq)),
                                scale_a=sg.reshape(-1).unsqueeze(1), scale_b=sx, out_dtype=ctx.dtype)
        else:
            xq, sx, wq, sw = ctx.saved_tensors
            gq, sg = quantize(g, E5M2)
            if ctx.needs_input_grad[0]:
                dx = _scaled_mm(gq, _col_major(wq), scale_a=sg, scale_b=sw, out_dtype=ctx.dtype)
            if ctx.needs_input_grad[1]:
                dw = _scaled_mm(_token_padded(gq).t().contiguous(), _col_major(_token_padded(xq)), scale_a=sg,
                                scale_b=sx, out_dtype=ctx.dtype)
        if dx is not None:
            dx = dx.reshape(ctx.shape)
        if dw is not None:
            dw = dw.to(ctx.w_dtype)      # an fp32 master weight whose FP8 copy was made ahead (``wq``)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0)
        return dx, dw, db, None, None, None


def fp8_linear(x: torch.Tensor, w: torch.Tensor, b=None, rowwise: bool = False, wq=None, sw=None) -> torch.Tensor:
    """``F.linear(x, w, b)`` with FP8 GEMMs forward and backward (module docstring); ``rowwise``: a scale
    per row of each operand instead of one per tensor. ``wq, sw``: ``quantize(bf16(w), e4m3)`` made ahead
    (tensorwise only; ``kernels.fp8_cast``): used instead of casting ``w``, which then only receives its
    gradient (in its own dtype, an fp32 master weight's too)."""
    if wq is not None and rowwise:
        raise ValueError("fp8_linear: a weight cast made ahead (wq, sw) is tensorwise; rowwise casts in the op")
    return FP8Linear.apply(x, w, b, rowwise, wq, sw)


def reference(x: torch.Tensor, w: torch.Tensor, b=None, rowwise: bool = False) -> torch.Tensor:
    """The same forward quantization in fp32 matmuls (what tests compare ``fp8_linear`` against)."""
    xq, sx = quantize(x.reshape(-1, x.shape[-1]), E4M3, -1 if rowwise else None)
    wq, sw = quantize(w, E4M3, -1 if rowwise else None)
    y = (xq.float() * sx) @ (wq.float() * sw).t()
    y = (y + b.float() if b is not None else y).to(x.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def underflow(t: torch.Tensor, dtype: torch.dtype = E4M3) -> float:
    """The share of nonzero elements of ``t`` that tensorwise scaling to ``dtype`` flushes to zero."""
    q, _ = quantize(t, dtype)
    nonzero = t != 0
    return ((q.float() == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1)


def _exercise(dtype):
    backward(fp8_linear(leaf(4, 32, dtype=torch.bfloat16), leaf(16, 32, dtype=torch.bfloat16)))


SPEC = register(OpSpec("fp8_linear", ops=(fp8_linear,), exercise=_exercise, triton=False,
                       flops=lambda x, w, *_: 2.0 * x.numel() * w.shape[0],
                       saves="the FP8 copies of x and W (half of bf16) and their two scales"))
