"""``opsmath::linear_cross_entropy``: an LM head's ``cross_entropy(x @ W^T + b, target)`` without the
logits tensor.

Math, for rows n (tokens), classes j < V, smoothing e, z = x_n W^T + b (N x V, never whole)::

    lse_n  = log sum_j exp(z_nj)
    loss_n = (1 - e) (lse_n - z_n,t) + e (lse_n - mean_j z_nj)        0 where t_n == ignore_index
    loss   = sum_n loss_n / #valid   (mean)   or   sum_n loss_n   (sum)
    G_nj   = s (softmax(z_n)_j - (1 - e) [j == t_n] - e / V)           s = 1/#valid or 1; 0 if ignored
    dx = G W        dW = G^T x        db = sum_n G_n

With a final-logit softcap c > 0 (Gemma-2's ``c * tanh(logits / c)``) the softmax, loss and ``G`` above
read y = c tanh(z / c) in place of z, and the gradient reaching z is ``G * (1 - (y / c)^2)``.

Shapes: x (N, C), W (V, C), b (V,) or None, target (N,) int64 -> loss (), dx (N, C), dW (V, C), db (V,).

The rows go through in chunks of ``chunk`` tokens (about 512 MiB of logits each): a cuBLAS GEMM writes
the chunk's logits in the compute dtype, one Triton program per row reads them twice (online max and
sum, then the gradient) and overwrites them with ``G`` in place, so the gradient never needs a second
logits-sized buffer; two more GEMMs add the chunk's share of dx and dW (dW accumulated in fp32, in place,
in row blocks that are rounded and freed one by one at the end: see ``_dw_blocks``). One chunk buffer
is reused for every chunk's logits. Where the model also returns the logits, each chunk's GEMM writes into
them, and G goes to a buffer of ``RETURNED_CHUNK_BYTES`` (64 MiB) of rows, in backward unless a softcap
hides the uncapped logits (``grads_in_backward``). The per-row pass is ``cross_entropy.rows``.
Because the loss is a scalar at the end of the graph, the gradients are computed in the forward (as
Liger-Kernel does) and backward only scales them by the incoming gradient: no logits are recomputed.
With ``compute_grad=False`` (eval graphs) only the loss is computed.

The logits are rounded to the compute dtype before the softmax, exactly as eager autocast's
``linear`` (bf16 out) followed by ``cross_entropy`` (upcast to fp32) does.
"""
from __future__ import annotations

from typing import Optional

import torch

from opsmath.kernels._common import first_order_only
from opsmath.kernels.cross_entropy import grad_scale, reduce, rows
from opsmath.kernels._spec import OpSpec, backward, leaf, register

CHUNK_BYTES = 512 * 2**20


RETURNED_CHUNK_BYTES = 64 * 2**20   # G's chunk where the logits are returned whole (they hold each chunk's)


def chunk_rows(V: int, N: int, return_logits: bool = False) -> int:
    """Rows per chunk so that its (bf16) logits take about ``CHUNK_BYTES`` (at least 64): large enough
    that the GEMMs run at full speed and the per-chunk dW update is a small share of the traffic. Where the
    model returns the logits, each chunk's GEMM writes into them and only G needs a buffer beside them,
    ``RETURNED_CHUNK_BYTES`` (the step holds the logits whole at that point: a large G buffer beside them
    raised GPT-2's step peak 12% above ``torch.compile``'s, H100, AMP, B4 T1024)."""
    return max(64, min(N, (RETURNED_CHUNK_BYTES if return_logits else CHUNK_BYTES) // (2 * V)))


_ADDMM_FP32_INPLACE: dict = {}   # device index -> whether addmm(acc, a, b, out_dtype=fp32, out=acc) is right
DW_BLOCK_BYTES = 256 * 2**20      # fp32 dW is accumulated in row blocks of about this size (see _dw_blocks)
DW_BLOCK_MIN_ROWS = 4096
DW_FP32_ADDMM = True              # dW's chunk products accumulate through cuBLAS's fp32-output addmm (see _accumulate)


def _inplace_fp32_addmm_ok(device: torch.device) -> bool:
    """Whether cuBLAS's low-precision x low-precision -> fp32 ``addmm`` (torch >= 2.8) accepts its own
    input as ``out``, checked once per device on a small case against fp32 math: a build without it
    (or one that got the aliasing wrong) falls back to a safe, slower path instead of a wrong dW."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _ADDMM_FP32_INPLACE:
        ok = False
        try:
            g = torch.Generator(device=device).manual_seed(0)
            a = torch.randn(64, 48, device=device, generator=g).bfloat16()
            b = torch.randn(48, 32, device=device, generator=g).bfloat16()
            acc = torch.randn(64, 32, device=device, generator=g)
            want = acc + a.float() @ b.float()
            got = torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            ok = got.data_ptr() == acc.data_ptr() and torch.allclose(acc, want, rtol=1e-3, atol=1e-3)
        except (RuntimeError, TypeError):
            ok = False
        _ADDMM_FP32_INPLACE[key] = ok
    return _ADDMM_FP32_INPLACE[key]


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place, with fp32 ``acc``: one GEMM that accumulates the low-precision product
    in fp32 and writes into ``acc`` itself when cuBLAS can (no second accumulator, no rounding of the
    partial product); otherwise the product is added in place (rounded to ``a``'s dtype first, as
    eager's bf16 GEMM output is)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif acc.is_cuda and DW_FP32_ADDMM and _inplace_fp32_addmm_ok(acc.device):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(a @ b)


def _dw_blocks(V: int, C: int) -> list[tuple[int, int]]:
    """Row ranges of dW, each about ``DW_BLOCK_BYTES`` in fp32 (at least 4096 rows, so each per-chunk
    GEMM stays large). dW is accumulated block by block so that, at the end, each fp32 block can be
    freed as soon as it is rounded to the weight's dtype: the fp32 accumulator and the rounded copy
    never exist whole at the same time (at V 128k, C 4096 that is 2.1 GB + 1.05 GB otherwise). Rows come
    in multiples of 128, so every block of G starts 16-byte aligned: cuBLAS takes its slow sm80 kernels
    for an operand that is not (H200, V 256000, C 3584: 18724-row blocks ran at align2)."""
    rows = max(DW_BLOCK_MIN_ROWS, -(-(DW_BLOCK_BYTES // (4 * max(C, 1))) // 128) * 128)
    return [(v, min(V, v + rows)) for v in range(0, V, rows)] or [(0, 0)]


# --------------------------------------------------------------------------------------------------
# The chunked op
# --------------------------------------------------------------------------------------------------


def capped(z: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(z / softcap)`` computed in fp32 and rounded once to z's dtype; z itself when 0."""
    return (softcap * torch.tanh(z.float() / softcap)).to(z.dtype) if softcap else z


def linear_cross_entropy_forward(x, w, b, target, ignore_index: int, smoothing: float, reduction: str,
                                 compute_grad: bool, return_logits: bool = False, softcap: float = 0.0,
                                 chunk: Optional[int] = None):
    """(loss, dx, dW, db, logits) as in the module doc; the gradients are empty tensors without
    ``compute_grad``, ``logits`` (N, V) in the compute dtype only with ``return_logits`` (when the model
    also returns them: the fp32 copy, log-softmax and gradient still never exist whole; softcapped where
    ``softcap`` is given)."""
    N = x.shape[0]
    V = w.shape[0]
    chunk = chunk or chunk_rows(V, N, return_logits)
    valid, scale = grad_scale(target, ignore_index, reduction)
    losses = torch.empty(N, device=x.device, dtype=torch.float32)
    dx, blocks, dws, db = _accumulators(x, V, b is not None) if compute_grad else (x.new_empty(0), [], [], None)
    logits = x.new_empty(N, V) if return_logits else x.new_empty(0)
    # one chunk's buffer, reused: the logits chunk, overwritten by G; beside returned logits, G's alone
    zbuf = x.new_empty(min(chunk, N) if compute_grad or not return_logits else 0, V)
    for s in range(0, N, chunk):
        xc = x[s:s + chunk]
        z = logits[s:s + chunk] if return_logits else zbuf[:xc.shape[0]]
        if b is not None:                                                     # (rows, V) compute dtype
            torch.addmm(b, xc, w.t(), out=z)
        else:
            torch.mm(xc, w.t(), out=z)
        g = zbuf[:xc.shape[0]] if return_logits and compute_grad else z
        losses[s:s + chunk] = rows(z, target[s:s + chunk], ignore_index, smoothing, scale, compute_grad, out=g,
                                   softcap=softcap)
        if return_logits and softcap:
            z.copy_(capped(z, softcap))
        if compute_grad:                                                      # g holds G
            _add_chunk(g, w, xc, dx[s:s + chunk], blocks, dws, db)
    z = g = zbuf = None
    dw = _rounded(dws, w.dtype) if compute_grad else w.new_empty(0)
    return (reduce(losses, valid, reduction), dx, dw, db.to(b.dtype) if db is not None else w.new_empty(0), logits)


def _accumulators(x, V: int, with_bias: bool):
    """(dx, dW's row blocks, their fp32 accumulators, fp32 db or None) for x (N, C) and V classes."""
    C = x.shape[1]
    blocks = _dw_blocks(V, C)
    dws = [torch.zeros(v1 - v0, C, device=x.device, dtype=torch.float32) for v0, v1 in blocks]
    db = torch.zeros(V, device=x.device, dtype=torch.float32) if with_bias else None
    return torch.empty_like(x), blocks, dws, db


def _add_chunk(g, w, xc, dx, blocks, dws, db) -> None:
    """A chunk's G (rows, V) into dx (its rows), the fp32 dW blocks and db (fp32, or None)."""
    torch.mm(g, w, out=dx)
    for (v0, v1), acc in zip(blocks, dws):
        _accumulate(acc, g[:, v0:v1].t(), xc)
    if db is not None:
        db += g.sum(0, dtype=torch.float32)


def _rounded(dws: list, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 dW blocks as one dW in ``dtype``, each block freed as soon as it is rounded (``dws`` is
    emptied)."""
    parts = []
    while dws:
        parts.append(dws.pop(0).to(dtype))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def grads_in_backward(compute_grad: bool, return_logits: bool, softcap: float) -> bool:
    """Where the model also returns the logits (no softcap), the gradients are computed in backward from
    them (``backward_from_logits``): the returned logits' own gradient (zeros, where the model's caller
    never reads them) joins G before the two GEMMs, so the step runs three GEMMs as an unfused graph
    does, not five, and holds no dX or fp32 dW from forward to backward. Under a softcap the returned
    logits are capped and G needs the uncapped ones: the gradients stay in the forward."""
    return compute_grad and return_logits and not softcap


def grads_in_forward(compute_grad: bool, return_logits: bool, softcap: float) -> bool:
    """Whether the forward computes dX, dW and db (the op's usual path; ``grads_in_backward``'s complement)."""
    return compute_grad and not grads_in_backward(compute_grad, return_logits, softcap)


def backward_from_logits(x, w, logits, target, dloss, dlogits, ignore_index: int, smoothing: float,
                         reduction: str, has_bias: bool, chunk: Optional[int] = None):
    """(dx, dW, db) of ``dloss * loss + <dlogits, logits>``: per chunk of rows, G = dloss * G_ce (the
    module doc's G, recomputed from the returned logits, log-sum-exp included) + dlogits, then dx = G W,
    dW = G^T x (fp32 blocks, rounded to W's dtype), db = sum_n G_n. Either gradient may be None."""
    N = x.shape[0]
    V = w.shape[0]
    chunk = chunk or chunk_rows(V, N, True)
    _, scale = grad_scale(target, ignore_index, reduction)
    scale = scale * dloss.float().reshape(1) if dloss is not None else scale
    dx, blocks, dws, db = _accumulators(x, V, has_bias)
    gbuf = x.new_empty(min(chunk, N), V)
    for s in range(0, N, chunk):
        g = gbuf[:min(chunk, N - s)]
        if dloss is not None:
            rows(logits[s:s + chunk], target[s:s + chunk], ignore_index, smoothing, scale, True, out=g)
            if dlogits is not None:
                g += dlogits[s:s + chunk]
        else:
            g.copy_(dlogits[s:s + chunk])
        _add_chunk(g, w, x[s:s + chunk], dx[s:s + chunk], blocks, dws, db)
    gbuf = g = None
    return dx, _rounded(dws, w.dtype), db


@torch.library.custom_op("opsmath::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], target: torch.Tensor,
                            ignore_index: int, label_smoothing: float, reduction: str, compute_grad: bool,
                            return_logits: bool = False, softcap: float = 0.0
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"opsmath::linear_cross_entropy takes reduction 'mean' or 'sum', got {reduction!r}")
    if softcap < 0:
        raise ValueError(f"opsmath::linear_cross_entropy takes a softcap >= 0 (0: none), got {softcap}")
    return linear_cross_entropy_forward(x, w, b, target, ignore_index, label_smoothing, reduction,
                                        grads_in_forward(compute_grad, return_logits, softcap), return_logits, softcap)


@linear_cross_entropy_op.register_fake
def _(x, w, b, target, ignore_index, label_smoothing, reduction, compute_grad, return_logits=False, softcap=0.0):
    loss = x.new_empty((), dtype=torch.float32)
    logits = x.new_empty(x.shape[0], w.shape[0]) if return_logits else x.new_empty(0)
    if not grads_in_forward(compute_grad, return_logits, softcap):
        return loss, x.new_empty(0), w.new_empty(0), w.new_empty(0), logits
    db = b.new_empty(b.shape) if b is not None else w.new_empty(0)
    return loss, torch.empty_like(x), torch.empty_like(w), db, logits


def _setup_context(ctx, inputs, output):
    x, w = inputs[0], inputs[1]
    _, dx, dw, db, logits = output
    ctx.return_logits = inputs[8] if len(inputs) > 8 else False
    ctx.softcap = inputs[9] if len(inputs) > 9 else 0.0
    ctx.has_bias = inputs[2] is not None
    ctx.compute_grad = inputs[7]
    ctx.deferred = grads_in_backward(ctx.compute_grad, ctx.return_logits, ctx.softcap)
    if ctx.deferred:   # backward_from_logits
        ctx.save_for_backward(x, w, logits, inputs[3])
        ctx.loss_args = inputs[4:7]   # ignore_index, label_smoothing, reduction
        ctx.bias_dtype = inputs[2].dtype if ctx.has_bias else None
    else:   # the returned logits can carry a gradient of their own (a z-loss under a softcap): then dx +=
        # G_l W and dW += G_l^T x, so x and W are kept too (and the capped logits, for tanh's derivative)
        kept = ((x, w, logits) if ctx.softcap else (x, w)) if ctx.return_logits else ()
        ctx.save_for_backward(dx, dw, db, *kept)
    ctx.set_materialize_grads(False)


def _backward(ctx, dloss, _ddx, _ddw, _ddb, dlogits):
    first_order_only("linear_cross_entropy")
    if not ctx.compute_grad:
        raise RuntimeError("opsmath::linear_cross_entropy was called with compute_grad=False; "
                           "it has no gradient to give")
    if ctx.deferred:
        x, w, logits, target = ctx.saved_tensors
        if dloss is None and dlogits is None:
            return (None,) * 10
        gx, gw, gb = backward_from_logits(x, w, logits, target, dloss, dlogits, *ctx.loss_args, ctx.has_bias)
        return gx, gw, gb.to(ctx.bias_dtype) if gb is not None else None, None, None, None, None, None, None, None
    dx, dw, db, *xw = ctx.saved_tensors
    g = dloss.to(torch.float32) if dloss is not None else torch.zeros((), device=dx.device)
    gx, gw = (dx * g).to(dx.dtype), (dw * g).to(dw.dtype)
    gb = (db * g).to(db.dtype) if ctx.has_bias else None
    if ctx.return_logits and dlogits is not None:   # (tracing may hand a zero gradient: still correct)
        x, w, *y = xw
        gl = dlogits.to(dx.dtype)
        if ctx.softcap:   # through y = c tanh(z / c): dz = dy (1 - (y / c)^2)
            gl = (dlogits.float() * (1 - (y[0].float() / ctx.softcap) ** 2)).to(dx.dtype)
        gx = gx + gl @ w
        gw = gw + (gl.t() @ x).to(gw.dtype)
        if ctx.has_bias:
            gb = gb + gl.sum(0, dtype=torch.float32).to(gb.dtype)
    return gx, gw, gb, None, None, None, None, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(x, w, b=None, target=None, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                         softcap=0.0):
    """``F.cross_entropy(F.linear(x, w, b), target, ...)`` for 2-D ``x`` without the logits tensor; with
    ``softcap`` c > 0, of ``c * tanh(F.linear(x, w, b) / c)``."""
    need = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))
    return linear_cross_entropy_op(x, w, b, target, ignore_index, label_smoothing, reduction, need, False,
                                   softcap)[0]


# --------------------------------------------------------------------------------------------------
# Op spec (src/opsmath/kernels/_spec.py)
# --------------------------------------------------------------------------------------------------


def _flops(x, w, *_):
    """Three GEMMs of (N, K) x (K, V): logits, dX and dW."""
    return 6 * x.shape[0] * x.shape[1] * w.shape[0]


def _workspace(x, w, b, target, ignore_index, smoothing, reduction, compute_grad, return_logits=False,
               softcap=0.0) -> int:
    """Bytes the op's peak holds beyond its outputs' size: one chunk of logits in the compute dtype and,
    where the weight is not fp32, dW's fp32 accumulator blocks less the rounded dW it returns (allocated
    after the chunks; an fp32 weight's blocks are the returned dW)."""
    N, C = x.shape
    V = w.shape[0]
    in_forward = grads_in_forward(compute_grad, return_logits, softcap)
    chunk = min(chunk_rows(V, N, return_logits), N) * V * x.element_size() if in_forward or not return_logits \
        else 0
    return chunk + (V * C * (4 - w.element_size()) if in_forward and w.dtype != torch.float32 else 0)


def _exercise(dtype: torch.dtype) -> None:
    t = torch.randint(0, 300, (8,))
    for smoothing, softcap in ((0.0, 0.0), (0.1, 0.0), (0.0, 30.0)):
        backward(linear_cross_entropy(leaf(8, 16, dtype=dtype), leaf(300, 16, dtype=dtype), leaf(300, dtype=dtype),
                                      t, -100, smoothing, "mean", softcap))
    with torch.no_grad():
        linear_cross_entropy(leaf(8, 16, dtype=dtype), leaf(300, 16, dtype=dtype), None, t, -100, 0.0, "sum")


# Inductor's own linear + cross-entropy is faster on the H200 (8192 tokens: 72.5 vs 87.7 ms at Gemma-2's
# head with its softcap, 39.5 vs 45.5 ms at Llama-3's; BENCHMARKS.md, "The LM head's loss"), but it keeps
# the whole (tokens x vocab) logits for backward, the largest activation of a long-sequence LM step:
# under a memory budget the chunked op stays
SPEC = register(OpSpec("linear_cross_entropy", ops=(torch.ops.opsmath.linear_cross_entropy.default,),
                       flops=_flops, inductor_fuses_better=True, kept_under_budget=True, exercise=_exercise,
                       workspace=_workspace,
                       saves="dX and dW computed in forward, the logits never kept; where the model returns "
                             "the logits, they are kept and the gradients computed from them in backward"))
