"""``opsmath::swiglu``: the gated MLP activation ``silu(a) * b`` (LLaMA, Mistral, Qwen), forward and backward.

Math, elementwise, with s = sigmoid(a) (fp32 math, stored in a's dtype)::

    y  = a * s * b
    da = dy * b * s * (1 + a * (1 - s))
    db = dy * a * s

Shapes: a, b (..., H) of one shape -> y (..., H) in their promoted dtype (as ``silu(a) * b``); da, db in
a's and b's dtypes. a and b may be row-strided views (the two halves of one ``chunk(2, -1)``
projection): rows are read through their stride, never copied.

Eager saves a, b and silu(a) for backward and moves 5 tensors forward (silu: read a, write s; mul:
read s, b, write y) and about 9 backward. Here forward reads a, b and writes y (3), backward reads
dy, a, b and writes da, db (5); silu(a) is recomputed, so only a and b are saved.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opsmath.kernels._common import first_order_only, use_triton
from opsmath.kernels._spec import OpSpec, backward, leaf, register

_BLOCK = 1024


def _rows(t: torch.Tensor, H: int) -> torch.Tensor:
    """``t`` as (rows, H) with unit column stride, a view when the layout allows it."""
    t2 = t.reshape(-1, H)
    return t2 if H == 0 or t2.stride(-1) == 1 else t2.contiguous()


@triton.jit
def _swiglu_fwd(a_ptr, b_ptr, y_ptr, H, stride_a, stride_b, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    a = tl.load(a_ptr + row * stride_a + cols, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + cols, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    tl.store(y_ptr + row * H + cols, (a * s * b).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd(dy_ptr, a_ptr, b_ptr, da_ptr, db_ptr, H, stride_a, stride_b, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    dy = tl.load(dy_ptr + row * H + cols, mask=m, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + row * stride_a + cols, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + cols, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    tl.store(da_ptr + row * H + cols, (dy * b * s * (1.0 + a * (1.0 - s))).to(da_ptr.dtype.element_ty), mask=m)
    tl.store(db_ptr + row * H + cols, (dy * a * s).to(db_ptr.dtype.element_ty), mask=m)


def _grid(M, H):
    return (M, triton.cdiv(H, _BLOCK))


def swiglu_forward_triton(a, b):
    H = a.shape[-1]
    a2, b2 = _rows(a, H), _rows(b, H)
    y = torch.empty(a.shape, device=a.device, dtype=torch.promote_types(a.dtype, b.dtype))
    if y.numel():
        _swiglu_fwd[_grid(a2.shape[0], H)](a2, b2, y, H, a2.stride(0), b2.stride(0), BLOCK=_BLOCK, num_warps=4)
    return y


def swiglu_backward_triton(dy, a, b):
    H = a.shape[-1]
    a2, b2 = _rows(a, H), _rows(b, H)
    dy = dy.contiguous()
    da = torch.empty(a.shape, device=a.device, dtype=a.dtype)
    db = torch.empty(b.shape, device=b.device, dtype=b.dtype)
    if da.numel():
        _swiglu_bwd[_grid(a2.shape[0], H)](dy, a2, b2, da, db, H, a2.stride(0), b2.stride(0), BLOCK=_BLOCK,
                                           num_warps=4)
    return da, db


def swiglu_reference(a, b):
    """y in the promoted dtype, fp32 math (fp64 for fp64 inputs)."""
    out = torch.promote_types(a.dtype, b.dtype)
    ct = torch.promote_types(out, torch.float32)
    af, bf = a.to(ct), b.to(ct)
    return (af * torch.sigmoid(af) * bf).to(out)


def swiglu_backward_reference(dy, a, b):
    ct = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    dyf, af, bf = dy.to(ct), a.to(ct), b.to(ct)
    s = torch.sigmoid(af)
    return (dyf * bf * s * (1 + af * (1 - s))).to(a.dtype), (dyf * af * s).to(b.dtype)


def _check(a, b):
    if a.shape != b.shape:
        raise ValueError(f"opsmath::swiglu needs a and b of one shape, got "
                         f"{a.dtype}{tuple(a.shape)} and {b.dtype}{tuple(b.shape)}")


@torch.library.custom_op("opsmath::swiglu", mutates_args=())
def swiglu_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check(a, b)
    return swiglu_forward_triton(a, b) if use_triton(a) else swiglu_reference(a, b).contiguous()


@swiglu_op.register_fake
def _(a, b):
    _check(a, b)
    return torch.empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)


@torch.library.custom_op("opsmath::swiglu_backward", mutates_args=())
def swiglu_backward_op(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(a):
        return swiglu_backward_triton(dy, a, b)
    da, db = swiglu_backward_reference(dy, a, b)
    return da.contiguous(), db.contiguous()


@swiglu_backward_op.register_fake
def _(dy, a, b):
    return torch.empty(a.shape, dtype=a.dtype, device=a.device), torch.empty(b.shape, dtype=b.dtype, device=b.device)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    first_order_only("swiglu")
    a, b = ctx.saved_tensors
    return swiglu_backward_op(dy, a, b)


swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.silu(a) * b``; see the module docstring."""
    return swiglu_op(a, b)


# --------------------------------------------------------------------------------------------------
# Op spec (src/opsmath/kernels/_spec.py)
# --------------------------------------------------------------------------------------------------


def _exercise(dtype: torch.dtype) -> None:
    backward(swiglu(leaf(3, 40, dtype=dtype), leaf(3, 40, dtype=dtype)))


# pointwise: Inductor fuses it with its neighbours, what it does best
SPEC = register(OpSpec("swiglu", ops=(torch.ops.opsmath.swiglu.default,), inductor_fuses_better=True,
                       exercise=_exercise,
                       saves="both inputs; silu is recomputed"))
