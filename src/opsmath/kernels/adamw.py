"""Fused AdamW step: gradient unscaling, global-norm clipping, decoupled weight decay, Adam moments,
bias correction and fp32 master weights, over thousands of tensors in two launches.

Math, for every parameter tensor with a gradient (t = its step count after this step)::

    norm  = || all grads ||_2 / grad_scale                      (pass 1: one multi-tensor reduction)
    coef  = min(1, max_norm / (norm + 1e-6))   (1 without clipping; as clip_grad_norm_: 0 for an inf
                                                norm, NaN for a NaN one, so such gradients reach the
                                                update as torch's clip + AdamW would pass them)
    skip everything if grad_scale's found_inf is set (or, with Gate.skip_nonfinite, norm is not finite)
    g     = grad / grad_scale * coef                            (pass 2: one multi-tensor update)
    p     = p * (1 - lr * wd)                  p: the fp32 master copy when master weights are on
    m     = b1 m + (1 - b1) g
    v     = b2 v + (1 - b2) g^2
    p     = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    param = p rounded to the parameter's dtype                  (master weights only)

Multi-tensor launches: every tensor is cut in chunks of ``CHUNK`` elements and one program runs per
chunk; it reads its tensor's addresses from int64 pointer tables, so one launch covers any number of
tensors of one dtype combination. Bandwidth: a chunk runs ``BLOCK``-element steps without masks (only
its last step is masked) and, when every address is 16-byte aligned (``ALIGNED``, checked on the
host), the compiler is told so, so loads and stores are 16-byte vectors. Per-tensor step counts are
read through a pointer table too, and lr / weight decay per param group (schedulers move them).

Caveats: tensors must be contiguous (``opsmath.optim`` sends others to the reference path, and a
non-contiguous gradient is copied: it is only read). The CPU path (``adamw_reference``) computes the
same math with torch ops.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from opsmath.kernels._spec import OpSpec, register

CHUNK = 16384     # elements per program
BLOCK = 1024      # elements per vectorized step of a program
_ALIGN = 16       # bytes: a 16-byte vector per thread and access


def global_grad_norm_reference(grads: list[torch.Tensor]) -> torch.Tensor:
    """||cat(grads)||_2 in fp32 (the scaled norm: divide by grad_scale for the true one)."""
    if not grads:
        return torch.zeros(())
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()


def adamw_reference(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lrs, wds, beta1, beta2, eps,
                    coef_scale, found_inf):
    """In place, per tensor. ``steps`` are the new step counts (floats); ``coef_scale`` = coef /
    grad_scale and ``found_inf`` are 0-d tensors; ``masters`` entries are None without master weights."""
    if bool(found_inf):
        return
    for p, g, m, v, pm, t, lr, wd in zip(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lrs, wds):
        # torch's single-tensor AdamW, op for op, so fp32 CPU results round as torch's do
        w = pm if pm is not None else p
        gf = g.to(m.dtype) * coef_scale.to(m.dtype)
        w.mul_(1 - lr * wd)
        m.lerp_(gf, 1 - beta1)
        v.mul_(beta2).addcmul_(gf, gf, value=1 - beta2)
        denom = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
        w.addcdiv_(m, denom, value=-(lr / (1 - beta1 ** t)))
        if pm is not None:
            p.copy_(w)


# --------------------------------------------------------------------------------------------------
# Multi-tensor plumbing, shared with src/opsmath/kernels/adamw_8bit.py
# --------------------------------------------------------------------------------------------------


@triton.jit
def chunk_of(CHUNK_TENSOR, CHUNK_START, SIZES, CHUNK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """(tensor index, first element, elements in this program's chunk) of ``program_id(0)``."""
    c = tl.program_id(0)
    i = tl.load(CHUNK_TENSOR + c)
    start = tl.multiple_of(tl.load(CHUNK_START + c), BLOCK)
    rem = tl.minimum(tl.load(SIZES + i) - start, CHUNK_SIZE)
    return i, start, rem


@triton.jit
def addr(TABLE, i, TY: tl.constexpr, ALIGNED: tl.constexpr):
    """Tensor ``i``'s base pointer from an int64 address table; 16-byte aligned when ``ALIGNED``."""
    p = tl.load(TABLE + i).to(tl.pointer_type(TY))
    if ALIGNED:
        p = tl.multiple_of(p, 16)   # on the pointer: the hint does not pass through int_to_ptr
    return p


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
       torch.int8: tl.int8, torch.uint8: tl.uint8}


def tl_type(dtype: torch.dtype):
    return _TL[dtype]


def _upload(values: list, dtype, device) -> torch.Tensor:
    """A small host list as a device tensor, without a host sync (pinned staging)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def aligned(tensors) -> bool:
    return all(t.data_ptr() % _ALIGN == 0 for t in tensors)


class MultiTensor:
    """Launch tables for one fixed list of tensors: the chunk table (built with tensor ops), address
    tables of the tensors whose storage stays put between steps (parameters, state; references are
    kept, so an address never dangles), the param-group index of each tensor, and the gradients'
    addresses, re-uploaded only when the allocator hands out different ones."""

    def __init__(self, sizes: list[int], static: list[list[torch.Tensor]], group_index: list[int], device,
                 quant_block: int = 1):
        self.device = device
        self.keep = static
        self.static = [_upload([t.data_ptr() for t in ts], torch.int64, device) for ts in static]
        self.static_aligned = all(aligned(ts) for ts in static)
        self.group = _upload(group_index, torch.int32, device)
        sz = torch.tensor(sizes, dtype=torch.int64)
        per = torch.clamp((sz + CHUNK - 1) // CHUNK, min=1)
        tensor_idx = torch.repeat_interleave(torch.arange(len(sizes)), per)
        first = torch.cumsum(per, 0) - per
        starts = (torch.arange(int(per.sum())) - first[tensor_idx]) * CHUNK
        self.sizes = sz.to(device)
        self.chunk_tensor = tensor_idx.to(torch.int32).to(device)
        self.chunk_start = starts.to(device)
        self.n_chunks = int(per.sum())
        self._grad_key: tuple = ()
        self._grad_table = None
        self._grad_aligned = False

    def grads(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """(address table, all aligned) for this step's gradients (contiguous ones)."""
        key = tuple(g.data_ptr() for g in grads)
        if key != self._grad_key:
            self._grad_key = key
            self._grad_table = _upload(list(key), torch.int64, self.device)
            self._grad_aligned = all(k % _ALIGN == 0 for k in key)
        return self._grad_table, self._grad_aligned


def group_table(values: list[float], device) -> torch.Tensor:
    """Per-param-group fp32 values (lr, weight decay) for the kernels."""
    return _upload(values, torch.float32, device)


class Gate(NamedTuple):
    """What scales and gates a step, read on the device by every program of the update kernels (so a
    step costs no host sync and no scalar torch ops): ``scale`` (1,) the GradScaler's scale (1 without
    one); ``found`` (1,) nonzero when it found inf/NaN; ``sumsq`` (1,) the scaled gradients' sum of
    squares, or None without clipping; ``norm_out`` (1,) receives ``sqrt(sumsq) / scale``; ``inc_out``
    (1,) receives 1, or 0 when the step is skipped (the caller adds it to the step counts).
    ``skip_nonfinite``: a non-finite clipped norm skips the step; without it the clip factor is what
    ``clip_grad_norm_`` multiplies by (0 for an inf norm, NaN for a NaN one) and the update goes on, as
    torch's does."""
    scale: torch.Tensor
    found: torch.Tensor
    sumsq: Optional[torch.Tensor]
    max_norm: float
    norm_out: torch.Tensor
    inc_out: torch.Tensor
    skip_nonfinite: bool = False

    def args(self) -> tuple:
        clip = self.sumsq is not None
        return (self.sumsq if clip else self.scale, self.scale, self.found, self.norm_out, self.inc_out,
                float(self.max_norm if clip else 1.0))


@triton.jit
def step_gate(SUMSQ, SCALE, FOUND, NORM_OUT, INC_OUT, max_norm, CLIP: tl.constexpr, SKIP_NONFINITE: tl.constexpr):
    """(skip, coef) with coef = min(1, max_norm / (norm + 1e-6)) / scale; program 0 publishes the norm
    and the step increment (every program computes the same values from the same inputs)."""
    scale = tl.load(SCALE)
    skip = tl.load(FOUND) != 0
    coef = 1.0 / scale
    if CLIP:
        norm = tl.sqrt_rn(tl.load(SUMSQ)) / scale
        if SKIP_NONFINITE:
            skip = skip | (norm != norm) | (norm == float("inf"))
        coef = coef * tl.where(norm != norm, norm, tl.minimum(max_norm / (norm + 1e-6), 1.0))
        if tl.program_id(0) == 0:
            tl.store(NORM_OUT, norm)
    if tl.program_id(0) == 0:
        tl.store(INC_OUT, tl.where(skip, 0.0, 1.0))
    return skip, coef


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _sumsq_kernel(G_PTRS, SIZES, CHUNK_TENSOR, CHUNK_START, PARTIAL, G_TY: tl.constexpr, ALIGNED: tl.constexpr,
                  CHUNK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    i, start, rem = chunk_of(CHUNK_TENSOR, CHUNK_START, SIZES, CHUNK_SIZE, BLOCK)
    g_ptr = addr(G_PTRS, i, G_TY, ALIGNED) + start
    acc = tl.zeros([BLOCK], tl.float32)
    full = rem // BLOCK * BLOCK
    for off in range(0, full, BLOCK):
        g = tl.load(g_ptr + off + tl.arange(0, BLOCK)).to(tl.float32)
        acc += g * g
    idx = full + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + idx, mask=idx < rem, other=0.0).to(tl.float32)
    acc += g * g
    tl.store(PARTIAL + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _adamw_step(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, idx, mask, other, coef, decay, step_size, bc2_sqrt,
                beta1, beta2, eps, P_TY: tl.constexpr, S_TY: tl.constexpr, HAS_MASTER: tl.constexpr):
    """One BLOCK of the update; ``mask``/``other`` are None on the unmasked steps."""
    g = tl.load(g_ptr + idx, mask=mask, other=other).to(tl.float32) * coef
    w = tl.load(w_ptr + idx, mask=mask, other=other).to(tl.float32) * decay
    m = tl.load(m_ptr + idx, mask=mask, other=other).to(tl.float32) * beta1 + g * (1.0 - beta1)
    v = tl.load(v_ptr + idx, mask=mask, other=other).to(tl.float32) * beta2 + g * g * (1.0 - beta2)
    w = w - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(m_ptr + idx, m.to(S_TY), mask=mask)
    tl.store(v_ptr + idx, v.to(S_TY), mask=mask)
    if HAS_MASTER:
        tl.store(w_ptr + idx, w, mask=mask)
    tl.store(p_ptr + idx, w.to(P_TY, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def step_scalars(STEP_PTRS, GROUP, LRS, WDS, i, beta1, beta2):
    """(bias-corrected step size, sqrt(1 - b2^t), 1 - lr wd) of tensor ``i`` at its new step t."""
    t = tl.load(tl.load(STEP_PTRS + i).to(tl.pointer_type(tl.float32))) + 1.0
    gi = tl.load(GROUP + i)
    lr = tl.load(LRS + gi)
    wd = tl.load(WDS + gi)
    step_size = lr / (1.0 - tl.exp2(t * tl.log2(beta1)))
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(t * tl.log2(beta2)))
    return step_size, bc2_sqrt, 1.0 - lr * wd


@triton.jit
def chunk_prologue(CHUNK_TENSOR, CHUNK_START, SIZES, STEP_PTRS, GROUP, LRS, WDS, P_PTRS, G_PTRS, W_PTRS, beta1, beta2,
                   P_TY: tl.constexpr, G_TY: tl.constexpr, HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr,
                   CHUNK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """This program's tensor ``i``, chunk (``start``, ``rem`` elements), step scalars, and the parameter,
    gradient and update-target pointers at the chunk (the target: the fp32 master, or the parameter)."""
    i, start, rem = chunk_of(CHUNK_TENSOR, CHUNK_START, SIZES, CHUNK_SIZE, BLOCK)
    step_size, bc2_sqrt, decay = step_scalars(STEP_PTRS, GROUP, LRS, WDS, i, beta1, beta2)
    p_ptr = addr(P_PTRS, i, P_TY, ALIGNED) + start
    g_ptr = addr(G_PTRS, i, G_TY, ALIGNED) + start
    if HAS_MASTER:
        w_ptr = addr(W_PTRS, i, tl.float32, ALIGNED) + start
    else:
        w_ptr = p_ptr
    return i, start, rem, step_size, bc2_sqrt, decay, p_ptr, g_ptr, w_ptr


@triton.jit
def _adamw_kernel(P_PTRS, G_PTRS, M_PTRS, V_PTRS, W_PTRS, STEP_PTRS, SIZES, GROUP, LRS, WDS, CHUNK_TENSOR,
                  CHUNK_START, SUMSQ, SCALE, FOUND, NORM_OUT, INC_OUT, max_norm, beta1, beta2, eps,
                  P_TY: tl.constexpr, G_TY: tl.constexpr, S_TY: tl.constexpr, HAS_MASTER: tl.constexpr,
                  CLIP: tl.constexpr, SKIP_NONFINITE: tl.constexpr, ALIGNED: tl.constexpr, CHUNK_SIZE: tl.constexpr,
                  BLOCK: tl.constexpr):
    """One program per chunk. W is the fp32 master (HAS_MASTER) whose rounding is written to P."""
    skip, coef = step_gate(SUMSQ, SCALE, FOUND, NORM_OUT, INC_OUT, max_norm, CLIP, SKIP_NONFINITE)
    if not skip:
        i, start, rem, step_size, bc2_sqrt, decay, p_ptr, g_ptr, w_ptr = chunk_prologue(
            CHUNK_TENSOR, CHUNK_START, SIZES, STEP_PTRS, GROUP, LRS, WDS, P_PTRS, G_PTRS, W_PTRS, beta1, beta2,
            P_TY, G_TY, HAS_MASTER, ALIGNED, CHUNK_SIZE, BLOCK)
        m_ptr = addr(M_PTRS, i, S_TY, ALIGNED) + start
        v_ptr = addr(V_PTRS, i, S_TY, ALIGNED) + start
        full = rem // BLOCK * BLOCK
        for off in range(0, full, BLOCK):
            _adamw_step(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, off + tl.arange(0, BLOCK), None, None, coef, decay,
                        step_size, bc2_sqrt, beta1, beta2, eps, P_TY, S_TY, HAS_MASTER)
        idx = full + tl.arange(0, BLOCK)
        _adamw_step(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, idx, idx < rem, 0.0, coef, decay,
                    step_size, bc2_sqrt, beta1, beta2, eps, P_TY, S_TY, HAS_MASTER)


def grad_sumsq_triton(tables: MultiTensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """sum of g^2 over ``grads`` (one dtype, the tensors ``tables`` was built for): a 0-d fp32 tensor."""
    gptrs, galigned = tables.grads(grads)
    partial = torch.empty(tables.n_chunks, dtype=torch.float32, device=tables.device)
    _sumsq_kernel[(tables.n_chunks,)](
        gptrs, tables.sizes, tables.chunk_tensor, tables.chunk_start, partial, G_TY=tl_type(grads[0].dtype),
        ALIGNED=galigned, CHUNK_SIZE=CHUNK, BLOCK=BLOCK, num_warps=4)
    return partial.sum()


def adamw_triton(tables: MultiTensor, grads, lrs: torch.Tensor, wds: torch.Tensor, beta1, beta2, eps,
                 gate: Gate, dtypes) -> None:
    """The update pass over the tensors ``tables`` holds: ``tables.keep`` = [params, exp_avgs,
    exp_avg_sqs, steps] (+ [masters]); ``lrs``/``wds`` per param group; ``dtypes`` = (param, grad,
    state) dtypes. Step counts are read, not advanced (the caller adds ``gate.inc_out``)."""
    gptrs, galigned = tables.grads(grads)
    has_master = len(tables.static) == 5
    p_ty, g_ty, s_ty = (tl_type(d) for d in dtypes)
    st = tables.static
    _adamw_kernel[(tables.n_chunks,)](
        st[0], gptrs, st[1], st[2], st[4] if has_master else st[0], st[3], tables.sizes, tables.group, lrs, wds,
        tables.chunk_tensor, tables.chunk_start, *gate.args(), float(beta1), float(beta2), float(eps),
        P_TY=p_ty, G_TY=g_ty, S_TY=s_ty, HAS_MASTER=has_master, CLIP=gate.sumsq is not None,
        SKIP_NONFINITE=gate.skip_nonfinite,
        ALIGNED=galigned and tables.static_aligned, CHUNK_SIZE=CHUNK, BLOCK=BLOCK, num_warps=4)


# --------------------------------------------------------------------------------------------------
# Op spec (src/opsmath/kernels/_spec.py)
# --------------------------------------------------------------------------------------------------


def exercise_tables(dtype, sdt, master: bool, sizes=(40, 15, 3000)):
    """Small params, grads and their tables for the op specs' exercise."""
    params = [torch.randn(n, dtype=dtype) for n in sizes]
    grads = [torch.randn_like(p) for p in params]
    state = [[torch.zeros_like(p, dtype=sdt) for p in params] for _ in range(2)]
    steps = [torch.zeros(()) for _ in params]
    static = [params, *state, steps] + ([[p.float() for p in params]] if master else [])
    return MultiTensor([p.numel() for p in params], static, [0] * len(params), params[0].device), grads


def exercise_gate(clip_grads=None) -> Gate:
    """A gate for the op specs' exercise: clipping when ``clip_grads`` are given."""
    one = torch.ones(1)
    sumsq = None
    if clip_grads is not None:
        tables = MultiTensor([g.numel() for g in clip_grads], [], [0] * len(clip_grads), clip_grads[0].device)
        sumsq = grad_sumsq_triton(tables, clip_grads).reshape(1)
    return Gate(one, torch.zeros(1), sumsq, 1.0, torch.empty(1), torch.empty(1))


def _exercise(dtype: torch.dtype) -> None:
    for master in (False, True):
        tables, grads = exercise_tables(dtype, torch.float32 if master else dtype, master)
        adamw_triton(tables, grads, group_table([1e-3], tables.device), group_table([0.01], tables.device),
                     0.9, 0.999, 1e-8, exercise_gate(grads if master else None),
                     (dtype, dtype, torch.float32 if master else dtype))


# the optimizer step (opsmath.optim.AdamW), not a rewrite family
SPEC = register(OpSpec("adamw", exercise=_exercise))
