"""Grouped GEMM reading its rows through an index: a mixture-of-experts layer's first GEMM without the
sorted copy of its input.

    y[r] = x[rows[r]] @ w[g]          for offs[g-1] <= r < offs[g]   (offs[-1] = 0)

Shapes: ``x`` [T, K] (the tokens), ``rows`` [S] int64 (the token of each row sorted by expert: ``S = T k``
under top-k routing), ``w`` [G, K, N] (any strides), ``offs`` [G] int32 as in ``grouped_mm.py``. Rows at or
past ``offs[G-1]`` (routed to no expert) are zeros.

The value is ``grouped_mm(x[rows], w, offs)``'s; what differs is that ``x[rows]`` ([S, K], k times the
token rows) is neither written nor saved for backward: the Triton kernels load each row tile's rows
through ``rows`` (a prologue gather), forward and weight gradient alike, and backward keeps ``x`` and
``rows`` instead of the gathered copy.

Backward: ``dx = zeros(T, K).index_put_((rows,), grouped(dy, w^T), accumulate=True)``, the backward of
``x[rows]`` as eager computes it (a token routed to k experts sums its k rows); ``dw[g] = x[rows_g]^T dy_g``.

Caveats:
- The Triton kernels run for 16-bit operands on CUDA (and in Triton's interpreter); elsewhere the op
  gathers, then runs ``grouped_mm``: the same values, none of the savings.
- Off by default: on an H100 (bf16, fwd + bwd) it ran at 0.78-0.89x the GPU time of the gather followed by
  ``torch._grouped_mm``, whose CUTLASS GEMM outruns these Triton kernels by more than the gather costs
  (BENCHMARKS.md, ``results/grouped-gemm-gather-h100-20261205.*``). ``OPSMATH_GATHER_GEMM=1`` takes it wherever
  it applies (the memory: ``x[rows]`` is not saved), ``auto`` where it measures faster on CUDA, per shape,
  cached per GPU like attention's (``gather_wins``).
"""
from __future__ import annotations

import os

import torch
import triton

from opsmath.kernels import autotune
from opsmath.kernels._common import first_order_only
from opsmath.kernels._spec import OpSpec, backward, leaf, register
from opsmath.kernels.grouped_mm import (FWD_TILES, WGRAD_TILES, _grouped_fwd, _grouped_wgrad, _on_triton, _tiles,
                                        grouped_mm, linear_layout, precision, weight_grad)


def _forward_triton(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    (S,), K, G, N = rows.shape, x.shape[1], w.shape[0], w.shape[2]
    y = x.new_zeros(S, N)

    def run(tile):
        bm, bn, bk, warps, stages = tile
        _grouped_fwd[(triton.cdiv(S, bm) + G, triton.cdiv(N, bn))](
            x, w, offs, y, K, N, G, *x.stride(), *w.stride(), *y.stride(), PRECISION=precision(x),
            BM=bm, BN=bn, BK=bk, GP=max(16, triton.next_power_of_2(G)), Rows=rows, GATHER=True,
            num_warps=warps, num_stages=stages)
    if S and N:
        run(_tiles("grouped_gather_fwd", FWD_TILES, y, G, K, N, run))
    return y


def _weight_grad_triton(x: torch.Tensor, rows: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor,
                        transposed: bool) -> torch.Tensor:
    """``dw[g] = x[rows_g]^T dy_g`` [G, K, N], laid out [G, N, K] in memory when ``transposed``."""
    G, K, N = offs.shape[0], x.shape[1], dy.shape[1]
    dw = x.new_empty(G, N, K).transpose(1, 2) if transposed else x.new_empty(G, K, N)

    def run(tile):
        bm, bn, bk, warps, stages = tile
        _grouped_wgrad[(G, triton.cdiv(K, bk), triton.cdiv(N, bn))](
            x, dy, offs, dw, K, N, *x.stride(), *dy.stride(), *dw.stride(), PRECISION=precision(x),
            BM=bm, BN=bn, BK=bk, Rows=rows, GATHER=True, num_warps=warps, num_stages=stages)
    if G and K and N:
        run(_tiles("grouped_gather_wgrad", WGRAD_TILES, dy, G, K, N, run))
    return dw


@torch.library.custom_op("opsmath::grouped_mm_gather", mutates_args=())
def grouped_mm_gather(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``y[r] = x[rows[r]] @ w[g]`` (module docstring)."""
    if _on_triton(x, w):
        return _forward_triton(x, rows, w, offs)
    return _past_end_zeroed(grouped_mm(x[rows], w, offs), offs)


@grouped_mm_gather.register_fake
def _(x, rows, w, offs):
    return x.new_empty(rows.shape[0], w.shape[2])


def _past_end_zeroed(y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``y`` with rows at or past ``offs[-1]`` zeroed (``torch._grouped_mm`` leaves them undefined)."""
    if offs.numel() == 0:
        return torch.zeros_like(y)
    inside = torch.arange(y.shape[0], device=y.device) < offs[-1]
    return torch.where(inside[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))


@torch.library.custom_op("opsmath::grouped_mm_gather_weight_grad", mutates_args=())
def gather_weight_grad(x: torch.Tensor, rows: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor,
                       transposed: bool) -> torch.Tensor:
    """``dw[g] = x[rows_g]^T dy_g`` [G, K, N], laid out [G, N, K] in memory when ``transposed``: an op of its
    own, so that a backward traced on fake tensors (AOTAutograd, Inductor) records it rather than
    launching its kernel."""
    if _on_triton(x, dy):
        return _weight_grad_triton(x, rows, dy, offs, transposed)
    return weight_grad(x[rows], dy, offs, transposed)


@gather_weight_grad.register_fake
def _(x, rows, dy, offs, transposed):
    G, K, N = offs.shape[0], x.shape[1], dy.shape[1]
    return x.new_empty(G, N, K).transpose(1, 2) if transposed else x.new_empty(G, K, N)


def _setup(ctx, inputs, output):
    x, rows, w, offs = inputs
    ctx.save_for_backward(x, rows, w, offs)


def _backward(ctx, dy):
    first_order_only("experts")
    x, rows, w, offs = ctx.saved_tensors
    dy = dy.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dxs = _past_end_zeroed(grouped_mm(dy, w.transpose(1, 2), offs), offs)
        dx = x.new_zeros(x.shape).index_put_((rows,), dxs.to(x.dtype), accumulate=True)
    if ctx.needs_input_grad[2]:
        dw = gather_weight_grad(x, rows, dy, offs, linear_layout(w))
    return dx, None, dw, None


grouped_mm_gather.register_autograd(_backward, setup_context=_setup)


def reference(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows]`` then per-group ``@ w[g]`` in fp32, zeros past the last group (what tests compare against)."""
    out = torch.zeros(rows.shape[0], w.shape[2], dtype=torch.float32)
    ends = [0] + offs.tolist()
    for g in range(w.shape[0]):
        s, e = ends[g], ends[g + 1]
        out[s:e] = x[rows[s:e]].float() @ w[g].float()
    return out


def gather_wins(S: int, T: int, K: int, N: int, G: int, dtype: torch.dtype, device: torch.device,
                transposed: bool) -> bool:
    """Whether to run this shape as ``grouped_mm_gather`` rather than ``x[rows]`` followed by ``grouped_mm``,
    by ``OPSMATH_GATHER_GEMM``: ``1`` always, ``auto`` where it measures faster (forward and backward, GPU
    kernel time; on CUDA, 16-bit, once per GPU and shape, cached on disk), else (the default: it measured
    slower, module docstring) never."""
    mode = os.environ.get("OPSMATH_GATHER_GEMM", "0")
    if mode != "auto":
        return mode == "1"
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or not S or not T:
        return False
    key = f"{str(dtype).replace('torch.', '')} S={S} T={T} G={G} K={K} N={N}{' linear' if transposed else ''}"
    return autotune.pick("grouped_gather", key, _candidates(S, T, K, N, G, dtype, device, transposed),
                         autotune.measure) == "gather"


def _candidates(S, T, K, N, G, dtype, device, transposed) -> dict:
    """Both spellings, forward and backward, on random inputs with the rows spread evenly over the groups
    (made at the first measurement: none for a cached choice)."""
    made: dict = {}

    def inputs():
        if not made:
            w = torch.randn(G, N, K, device=device, dtype=dtype).transpose(1, 2) if transposed \
                else torch.randn(G, K, N, device=device, dtype=dtype)
            made.update(x=torch.randn(T, K, device=device, dtype=dtype, requires_grad=True), w=w.requires_grad_(True),
                        rows=torch.sort(torch.randint(0, T, (S,), device=device)).values,
                        offs=(torch.arange(1, G + 1, device=device) * S // G).to(torch.int32),
                        dy=torch.randn(S, N, device=device, dtype=dtype))
        return made

    def step(gathered: bool):
        def run():
            a = inputs()
            y = grouped_mm_gather(a["x"], a["rows"], a["w"], a["offs"]) if gathered \
                else grouped_mm(a["x"][a["rows"]], a["w"], a["offs"])
            return torch.autograd.grad(y, (a["x"], a["w"]), a["dy"])
        return run
    return {"index+grouped": step(False), "gather": step(True)}


def _flops(x, rows, w, offs):
    return 2.0 * rows.shape[0] * x.shape[1] * w.shape[2]


def _exercise(dtype):
    for n, transposed in ((8, False), (12, True)):   # a plain stack, and nn.Linear weights read transposed
        x = leaf(5, 8, dtype=dtype)
        w = leaf(2, n, 8, dtype=dtype).transpose(1, 2) if transposed else leaf(2, 8, n, dtype=dtype)
        rows = torch.tensor([0, 3, 3, 1, 4, 2, 0])
        backward(grouped_mm_gather(x, rows, w, torch.tensor([3, 6], dtype=torch.int32)))


SPEC = register(OpSpec("experts_gather", ops=(torch.ops.opsmath.grouped_mm_gather.default,), flops=_flops,
                       exercise=_exercise, profile=("grouped GEMM", ("grouped", "cutlass")),
                       saves="the token rows (not their sorted copy), the row index and the expert weights"))
