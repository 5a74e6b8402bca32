"""Fused AdamW step: gradient unscaling, global-norm clipping, decoupled weight decay, Adam moments,
bias correction and fp32 master weights, over thousands of tensors in two launches.

Math, for every parameter tensor with a gradient (t = its step count after this step)::

    norm  = || all grads ||_2 / grad_scale                      (pass 1: one multi-tensor reduction)
    coef  = min(1, max_norm / (norm + 1e-6))   (1 without clipping; as clip_grad_norm_)
    skip everything if grad_scale's found_inf is set or norm is not finite
    g     = grad / grad_scale * coef                            (pass 2: one multi-tensor update)
    p     = p * (1 - lr * wd)                  p: the fp32 master copy when master weights are on
    m     = b1 m + (1 - b1) g
    v     = b2 v + (1 - b2) g^2
    p     = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    param = p rounded to the parameter's dtype                  (master weights only)

Multi-tensor: every tensor is cut in chunks of ``CHUNK`` elements; one program per chunk reads its
tensor's addresses from int64 pointer tables, so one launch covers any number of tensors of one dtype
combination. Per-tensor lr, weight decay and step come from small tables too (param groups differ).
The CPU path (``adamw_reference``) computes the same math with torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._spec import OpSpec, register

CHUNK = 2048


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


@triton.jit
def _sumsq_kernel(G_PTRS, SIZES, CHUNK_TENSOR, CHUNK_START, PARTIAL, G_TY: tl.constexpr,
                  CHUNK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    i = tl.load(CHUNK_TENSOR + c)
    start = tl.load(CHUNK_START + c)
    n = tl.load(SIZES + i)
    g_ptr = tl.load(G_PTRS + i).to(tl.pointer_type(G_TY))
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, CHUNK_SIZE, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        g = tl.load(g_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
        acc += g * g
    tl.store(PARTIAL + c, tl.sum(acc, 0))


@triton.jit
def _adamw_kernel(P_PTRS, G_PTRS, M_PTRS, V_PTRS, W_PTRS, SIZES, STEPS, LRS, WDS, CHUNK_TENSOR, CHUNK_START,
                  COEF, FOUND, beta1, beta2, eps,
                  P_TY: tl.constexpr, G_TY: tl.constexpr, S_TY: tl.constexpr, HAS_MASTER: tl.constexpr,
                  CHUNK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per chunk. W is the fp32 master (HAS_MASTER) whose rounding is written to P."""
    if tl.load(FOUND) == 0:
        c = tl.program_id(0)
        i = tl.load(CHUNK_TENSOR + c)
        start = tl.load(CHUNK_START + c)
        n = tl.load(SIZES + i)
        t = tl.load(STEPS + i)
        lr = tl.load(LRS + i)
        wd = tl.load(WDS + i)
        coef = tl.load(COEF)
        p_ptr = tl.load(P_PTRS + i).to(tl.pointer_type(P_TY))
        g_ptr = tl.load(G_PTRS + i).to(tl.pointer_type(G_TY))
        m_ptr = tl.load(M_PTRS + i).to(tl.pointer_type(S_TY))
        v_ptr = tl.load(V_PTRS + i).to(tl.pointer_type(S_TY))
        if HAS_MASTER:
            w_ptr = tl.load(W_PTRS + i).to(tl.pointer_type(tl.float32))
        else:
            w_ptr = p_ptr
        step_size = lr / (1.0 - tl.exp2(t * tl.log2(beta1)))
        bc2_sqrt = tl.sqrt(1.0 - tl.exp2(t * tl.log2(beta2)))
        decay = 1.0 - lr * wd
        for off in range(0, CHUNK_SIZE, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            mask = idx < n
            g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32) * coef
            w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32) * decay
            m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32) * beta1 + g * (1.0 - beta1)
            v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32) * beta2 + g * g * (1.0 - beta2)
            w = w - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
            tl.store(m_ptr + idx, m.to(S_TY), mask=mask)
            tl.store(v_ptr + idx, v.to(S_TY), mask=mask)
            if HAS_MASTER:
                tl.store(w_ptr + idx, w, mask=mask)
            tl.store(p_ptr + idx, w.to(P_TY, fp_downcast_rounding="rtne"), mask=mask)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _ptrs(tensors, device) -> torch.Tensor:
    """int64 addresses of ``tensors``, copied to ``device`` without a host sync (pinned staging)."""
    host = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


class _Tables:
    """Chunk and pointer tables for one list of tensors. Everything but the gradient addresses (and
    lr / weight decay when a scheduler moves them) is built once and reused while the same tensors
    stay in place; the chunk table is built with tensor ops, not a Python loop over chunks."""

    def __init__(self, key, sizes: list[int], static: list[list[torch.Tensor]], device):
        self.key = key
        self.static = [_ptrs(ts, device) for ts in static]
        sizes = torch.tensor(sizes, dtype=torch.int64)
        per = (sizes + CHUNK - 1) // CHUNK
        per = torch.maximum(per, torch.ones_like(per))
        tensor_idx = torch.repeat_interleave(torch.arange(len(sizes)), per)
        first = torch.cumsum(per, 0) - per
        starts = (torch.arange(int(per.sum())) - first[tensor_idx]) * CHUNK
        self.sizes = sizes.to(device)
        self.chunk_tensor = tensor_idx.to(torch.int32).to(device)
        self.chunk_start = starts.to(device)
        self.n_chunks = int(per.sum())
        self.hparams: tuple = ()
        self.lrs = self.wds = None

    def hyper(self, lrs, wds, device):
        if (tuple(lrs), tuple(wds)) != self.hparams:
            self.hparams = (tuple(lrs), tuple(wds))
            self.lrs = torch.tensor(lrs, dtype=torch.float32).to(device)
            self.wds = torch.tensor(wds, dtype=torch.float32).to(device)
        return self.lrs, self.wds


def _tables(cache: dict | None, name, sizes: list[int], static, device) -> _Tables:
    """Tables for tensors of ``sizes`` whose ``static`` tensors keep their addresses between steps."""
    key = (tuple(sizes), tuple(t.data_ptr() for ts in static for t in ts))
    if cache is not None and name in cache and cache[name].key == key:
        return cache[name]
    tables = _Tables(key, sizes, static, device)
    if cache is not None:
        cache[name] = tables
    return tables


def grad_sumsq_triton(grads: list[torch.Tensor], cache: dict | None = None) -> torch.Tensor:
    """sum of g^2 over every grad (one launch per grad dtype), as a 0-d fp32 device tensor."""
    device = grads[0].device
    total = torch.zeros((), dtype=torch.float32, device=device)
    by_dtype: dict = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dt, gs in by_dtype.items():
        tb = _tables(cache, ("sumsq", device, dt), [g.numel() for g in gs], [], device)
        partial = torch.empty(tb.n_chunks, dtype=torch.float32, device=device)
        _sumsq_kernel[(tb.n_chunks,)](
            _ptrs(gs, device), tb.sizes, tb.chunk_tensor, tb.chunk_start, partial,
            G_TY=_TL[dt], CHUNK_SIZE=CHUNK, BLOCK=512, num_warps=4)
        total = total + partial.sum()
    return total


def adamw_triton(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lrs, wds, beta1, beta2, eps,
                 coef_scale, found_inf, cache: dict | None = None):
    """The update pass over tensors that share (param dtype, grad dtype, state dtype, master or not).
    ``steps`` is a device fp32 tensor of new step counts, one per tensor; ``cache`` (a dict the caller
    keeps) lets the tables of unchanged tensors be reused across steps."""
    device = params[0].device
    has_master = masters[0] is not None
    static = [params, exp_avgs, exp_avg_sqs] + ([masters] if has_master else [])
    tb = _tables(cache, ("update", device, params[0].dtype, has_master, beta1, beta2, eps),
                 [p.numel() for p in params], static, device)
    lr_t, wd_t = tb.hyper(lrs, wds, device)
    f32 = dict(dtype=torch.float32, device=device)
    _adamw_kernel[(tb.n_chunks,)](
        tb.static[0], _ptrs(grads, device), tb.static[1], tb.static[2], tb.static[3 if has_master else 0],
        tb.sizes, steps, lr_t, wd_t, tb.chunk_tensor, tb.chunk_start,
        coef_scale.reshape(1).to(**f32), found_inf.reshape(1).to(**f32), float(beta1), float(beta2), float(eps),
        P_TY=_TL[params[0].dtype], G_TY=_TL[grads[0].dtype], S_TY=_TL[exp_avgs[0].dtype], HAS_MASTER=has_master,
        CHUNK_SIZE=CHUNK, BLOCK=512, num_warps=4)


# --------------------------------------------------------------------------------------------------
# Op spec (kernels/_spec.py)
# --------------------------------------------------------------------------------------------------


def _exercise(dtype: torch.dtype) -> None:
    for master, clip in ((False, True), (True, False)):
        params = [torch.randn(40, dtype=dtype), torch.randn(3, 5, dtype=dtype)]
        grads = [torch.randn_like(p) for p in params]
        sdt = torch.float32 if master else dtype
        coef = grad_sumsq_triton(grads).rsqrt() if clip else torch.ones(())
        adamw_triton(params, grads, [torch.zeros_like(p, dtype=sdt) for p in params],
                     [torch.zeros_like(p, dtype=sdt) for p in params],
                     [p.float() for p in params] if master else [None] * len(params),
                     torch.ones(len(params)), [1e-3] * 2, [0.01] * 2, 0.9, 0.999, 1e-8, coef, torch.zeros(()))


# the optimizer step (opsmath.optim.AdamW), not a rewrite family
SPEC = register(OpSpec("adamw", exercise=_exercise))
