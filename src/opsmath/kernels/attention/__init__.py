"""``opsmath::attention``: fused scaled-dot-product attention, forward and backward.

Math (per batch b, query head h, with kv head g = h // (H // Hkv) for GQA/MQA)::

    S   = scale * Q K^T                             Q: (B, H, Sq, D)   K, V: (B, Hkv, Sk, D)
    S   = softcap * tanh(S / softcap)  if softcap   (logit softcapping, Gemma-2; 0 = off)
    S   = S + bias
    S   = where(mask, mask_fill, S)                 bias, mask: broadcastable to (B, H, Sq, Sk)
    S   = where(j > i, -inf, S)    if is_causal     (top-left aligned, as tril(ones(Sq, Sk)) spells it)
    S   = where(j <= i - window, -inf, S)  if window > 0   (sliding window: each query sees its last
                                                   ``window`` keys; the kernels skip key blocks outside it)
    P   = softmax(S, -1)                            stats: (B, H, Sq, 2) fp32 = (row max m, log row sum)
          (a row whose every entry is -inf gets P = 0: output 0, no gradient, as SDPA's own backends and
          its math path; softmax written out in eager would give NaN there; stats (0, +inf))
    Pd  = P * keep / (1 - p)   keep = hash(seed, flat index into (B, H, Sq, Sk)) >= p
    O   = Pd V                                      O: (B, H, Sq, D) in q.dtype

Backward (FlashAttention-2, with ``delta = rowsum(dO * O)``)::

    dV = Pd^T dO                     dP = (dO V^T) * keep / (1 - p)
    dS = P * (dP - delta), 0 where masked      dbias = dS reduced over bias's broadcast dims
    dR = dS * (1 - tanh^2(scale Q K^T / softcap))   (dR = dS without softcap)
    dQ = scale dR K      dK = scale dR^T Q

The S x S matrix never exists in memory in the Triton path: forward keeps a running max and sum
(online softmax) and saves (m, log l) per row (lse = their sum; kept apart so that rows
whose every entry is a large finite fill such as finfo.min keep their precision); backward recomputes P block by block and regenerates the dropout mask
from (seed, offset). K/V of GQA are read per kv head, never repeated.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from opsmath.kernels._common import (check_seed, dropout_keep, first_order_only, flat_offsets, new_seed, traced_on_cuda,
                                     use_triton)
from opsmath.kernels.attention.kernel import attention_backward_triton, attention_forward_triton
from opsmath.kernels._spec import backward, leaf
from opsmath.kernels.attention.configs import configs_for, forced_config

# --------------------------------------------------------------------------------------------------
# PyTorch reference: the CPU implementation and what the tests compare against.
# --------------------------------------------------------------------------------------------------


def _reference_probs(q, k, v, bias, mask, mask_fill, is_causal, scale, dropout_p, seed, softcap=0.0, window=0):
    """fp32 (fp64 for fp64) S, P, dropout-applied Pd, the keep mask (None without dropout), what is
    masked (bool, broadcastable), K/V repeated to H heads, and the softcap's derivative (1.0 without)."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, Sq, D = q.shape
    Sk, rep = k.shape[2], H // k.shape[1]
    kf = k.to(ct).repeat_interleave(rep, dim=1)
    vf = v.to(ct).repeat_interleave(rep, dim=1)
    s = (q.to(ct) @ kf.transpose(-1, -2)) * scale
    dcap = 1.0
    if softcap:
        t = torch.tanh(s / softcap)
        s, dcap = softcap * t, 1.0 - t * t
    if bias is not None:
        s = s + bias.to(ct)
    masked = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=q.device)
    if mask is not None:
        s = s.masked_fill(mask, mask_fill)
        masked = masked | mask
    if is_causal:
        upper = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(upper, float("-inf"))
        masked = masked | upper
    if window > 0:
        left = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(-window)
        s = s.masked_fill(left, float("-inf"))
        masked = masked | left
    p = torch.softmax(s, dim=-1).masked_fill(torch.isneginf(s).all(-1, keepdim=True), 0.0)   # SDPA's rows: 0
    keep = dropout_keep(seed, flat_offsets(p.shape, q.device), dropout_p) if dropout_p > 0 else None
    pd = p * keep / (1.0 - dropout_p) if keep is not None else p
    return s, p, pd, keep, masked, kf, vf, dcap


def attention_reference(q, k, v, bias, mask, mask_fill, is_causal, scale, dropout_p, seed, softcap=0.0, window=0):
    """Returns (out in q.dtype, stats fp32 (B, H, Sq, 2)). Computes in fp32 (fp64 when given fp64)."""
    s, p, pd, _, _, _, vf, _ = _reference_probs(q, k, v, bias, mask, mask_fill, is_causal, scale, dropout_p, seed,
                                                softcap, window)
    m = s.amax(-1, keepdim=True)
    dead = m == float("-inf")   # every entry removed: stats (0, +inf), as the Triton forward stores them
    log_l = torch.logsumexp(s - m.masked_fill(dead, 0.0), dim=-1).masked_fill(dead.squeeze(-1), float("inf"))
    stats = torch.stack([m.masked_fill(dead, 0.0).squeeze(-1), log_l], dim=-1)
    return (pd @ vf).to(q.dtype), stats.float()


def _attention_reference_backward(dout, q, k, v, bias, mask, mask_fill, is_causal, scale, dropout_p, seed, bias_grad,
                                  softcap=0.0, window=0):
    """The module docstring's backward, in plain torch (custom-op bodies run below autograd)."""
    _, p, pd, keep, masked, kf, vf, dcap = _reference_probs(q, k, v, bias, mask, mask_fill, is_causal, scale,
                                                            dropout_p, seed, softcap, window)
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    do = dout.to(p.dtype)
    dv = pd.transpose(-1, -2) @ do
    dp = do @ vf.transpose(-1, -2)
    if keep is not None:
        dp = dp * keep / (1.0 - dropout_p)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    ds = ds.masked_fill(masked, 0.0)
    dr = ds * dcap
    dq = (dr @ kf) * scale
    dk = (dr.transpose(-1, -2) @ q.to(p.dtype)) * scale
    dk = dk.view(B, Hkv, H // Hkv, Sk, D).sum(2)
    dv = dv.view(B, Hkv, H // Hkv, Sk, D).sum(2)
    dbias = ds.float() if bias_grad else None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias


# --------------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------------


# ``triton_op``s, not opaque custom ops: on CUDA Inductor traces into them (each function is also its own
# fake kernel) and launches the Triton kernels from its generated code, as it does its own, so a compiled
# step pays none of the custom op's Python dispatch per call (measured on the H200 at 0.19 ms forward and
# 0.5 ms backward per layer of host time, the fleet's Mistral and T5 rows); op by op, and on CPU (the
# reference, ``traced_on_cuda``), they run as any custom op.
@torch.library.triton_op("opsmath::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                 mask: Optional[torch.Tensor], mask_fill: float, is_causal: bool, scale: float,
                 dropout_p: float, seed: Optional[torch.Tensor], softcap: float = 0.0, window: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    check_seed("attention", dropout_p, seed)
    if use_triton(q):
        out, stats = attention_forward_triton(q, k, v, bias, mask, mask_fill, is_causal, scale, dropout_p, seed,
                                              softcap, window)
    else:
        out, stats = attention_reference(q, k, v, bias, mask, mask_fill, is_causal, scale, dropout_p, seed, softcap,
                                         window)
    return out.contiguous(), stats.contiguous()


@torch.library.triton_op("opsmath::attention_backward", mutates_args=())
def attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, stats: torch.Tensor, bias: Optional[torch.Tensor],
                          mask: Optional[torch.Tensor], mask_fill: float, is_causal: bool, scale: float,
                          dropout_p: float, seed: Optional[torch.Tensor], bias_grad: bool, softcap: float = 0.0,
                          window: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(q):
        dq, dk, dv, dbias = attention_backward_triton(dout, q, k, v, out, stats, bias, mask, mask_fill,
                                                      is_causal, scale, dropout_p, seed, bias_grad, softcap, window)
    else:
        dq, dk, dv, dbias = _attention_reference_backward(dout, q, k, v, bias, mask, mask_fill, is_causal,
                                                          scale, dropout_p, seed, bias_grad, softcap, window)
    if dbias is None:
        dbias = q.new_empty((0,), dtype=torch.float32)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dbias.contiguous()


def _setup_context(ctx, inputs, output):
    q, k, v, bias, mask, mask_fill, is_causal, scale, dropout_p, seed, softcap, window = inputs
    out, stats = output
    ctx.save_for_backward(q, k, v, bias, mask, seed, out, stats)
    ctx.args = (mask_fill, is_causal, scale, dropout_p, softcap, window)


def _backward(ctx, dout, dstats):
    first_order_only("attention")
    q, k, v, bias, mask, seed, out, stats = ctx.saved_tensors
    mask_fill, is_causal, scale, dropout_p, softcap, window = ctx.args
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = attention_backward_op(dout, q, k, v, out, stats, bias, mask, mask_fill, is_causal,
                                              scale, dropout_p, seed, bias_grad, softcap, window)
    if bias_grad:
        dims = [i for i in range(4) if bias.shape[i] == 1 and dbias.shape[i] != 1]
        dbias = (dbias.sum(dims, keepdim=True) if dims else dbias).to(bias.dtype)
    else:
        dbias = None
    return dq, dk, dv, dbias, None, None, None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)
traced_on_cuda(attention_op)
traced_on_cuda(attention_backward_op)


def attention(q, k, v, bias=None, mask=None, mask_fill=float("-inf"), is_causal=False, scale=None,
              dropout_p=0.0, seed=None, softcap=0.0, window=0):
    """Convenience entry point: ``O = attention(q, k, v, ...)`` with the op's semantics (see module doc).
    ``scale`` defaults to 1/sqrt(D); a fresh seed is drawn when dropout is on and none is given."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if seed is None and dropout_p > 0:
        seed = new_seed(q)
    return attention_op(q, k, v, bias, mask, mask_fill, is_causal, scale, dropout_p, seed, softcap, window)[0]


# --------------------------------------------------------------------------------------------------
# Op spec (src/opsmath/kernels/_spec.py)
# --------------------------------------------------------------------------------------------------


def attention_flops(q, k, v=None, bias=None, *rest):
    """QK^T and PV over the (i, j) pairs the kernels compute, 2 FLOPs per multiply-add: B*H x Sq x Sk x D
    each, causal about half of it (S (S + 1) / 2 pairs), causal with a window of w < S keys w S - w (w - 1) / 2.
    Takes the arguments of either graph op of the family: ``opsmath.attention`` (q, k, v, bias, mask,
    mask_fill, is_causal, ..., window at position 11) or ``tuning.sdpa`` (q, k, v, bias,
    is_causal, ...: a bool in fifth place, where the other has a mask tensor or None)."""
    B, H, Sq, D = q.shape
    if rest and isinstance(rest[0], bool):
        is_causal, window = rest[0], 0
    else:
        is_causal, window = (rest[2] if len(rest) > 2 else False), (rest[7] if len(rest) > 7 else 0)
    Sk = k.shape[2]
    pairs = Sq * Sk
    if is_causal and window and window < Sq:
        pairs = window * Sq - window * (window - 1) // 2
    elif is_causal:
        pairs = Sq * (Sq + 1) // 2
    return 4 * B * H * pairs * D


def exercise(dtype: torch.dtype) -> None:
    """Each flag in the block configurations the GPU launches (each variant takes ~10 s to compile for
    sm_90, so the flags are spread over three bf16 cases and one fp32 case)."""
    seed = torch.tensor(7)
    cases = [(64, 1, True, False, False, 0.0, 0.0, 0)] if dtype == torch.float32 else [
        (64, 2, True, False, False, 0.0, 0.0, 7), (128, 2, False, True, False, 0.1, 0.0, 0),
        (32, 1, True, False, True, 0.0, 0.0, 0), (128, 2, True, True, False, 0.0, 30.0, 5)]
    for D, Hkv, causal, has_bias, has_mask, p, cap, window in cases:
        q, k, v = leaf(1, 2, 20, D, dtype=dtype), leaf(1, Hkv, 20, D, dtype=dtype), leaf(1, Hkv, 20, D, dtype=dtype)
        bias = leaf(1, 1, 20, 20, dtype=dtype) if has_bias else None
        mask = torch.rand(1, 1, 20, 20) > 0.2 if has_mask else None
        if mask is not None:
            mask[..., 0] = True
        with forced_config(configs_for(D)[1 if has_bias else 0]):
            backward(attention_op(q, k, v, bias, mask, float("-inf"), causal, D ** -0.5, p, seed, cap, window)[0])


# Up to this head dim opsmath's kernel measured faster than Inductor's compiled chain on softcapped attention:
# H200, bf16, causal, cap 50, fwd+bwd (BENCHMARKS.md, attention with logit softcapping): D256 (B4 H8 S2048)
# 1.45 ms in its 128x64 tiles against 1.73 ms compiled (``results/attention_config_sweep-*``); at D128 it wins 1.95x
# (S2048) and 2.92x (S4096). Above it (not measured) the rewrite leaves softcapped attention to Inductor;
# op by op it keeps it.
SOFTCAP_INDUCTOR_HEAD_DIM = 256

# the family's op spec (registered in tuning.py, which also defines its vendor stand-in op)
