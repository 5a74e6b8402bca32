"""Grouped GEMM over rows sorted by group, the computation of a mixture-of-experts layer.

    y[r] = x[r] @ w[g]          for offs[g-1] <= r < offs[g]   (offs[-1] = 0)

Shapes: ``x`` [S, K] (rows sorted by group), ``w`` [G, K, N], ``offs`` [G] int32, the running end of
each group (a cumulative sum of the group sizes). Rows at or past ``offs[G-1]`` belong to no group.

``grouped_mm(x, w, offs)`` is what the experts rewrite emits: ``torch._grouped_mm`` where PyTorch's
grouped kernel takes the operands (``native``: bf16, ``K`` and ``N`` multiples of 8, on CUDA and CPU;
Inductor then lowers it with its own templates), else ``opsmath::grouped_mm``, one ``mm`` per group.

Caveats:
- ``torch._grouped_mm`` leaves rows past ``offs[G-1]`` undefined (NaN on CPU); ``opsmath::grouped_mm``
  writes zeros there. Callers mask such rows (``src/opsmath/patterns/experts/__init__.py`` does when routing can leave any).
- ``opsmath::grouped_mm`` takes fp32, fp16 and unaligned sizes. For 16-bit operands on CUDA (and in
  Triton's interpreter) its Triton kernels find each row tile's group from ``offs`` on the device: no host
  sync (fp32: see ``TRITON_DTYPES``). Row tiles of
  ``BM`` are laid out group after group (``cdiv(size_g, BM)`` each, at most ``S / BM + G`` in all, the
  grid's bound); the weight gradient runs one program per (group, K block, N block) over that group's
  rows. Tile shapes are measured per GPU and shape bucket at the first launch (``FWD_TILES``,
  ``WGRAD_TILES``). Elsewhere it is one ``mm`` per group, reading ``offs`` on the host. Inductor treats
  it as opaque.
- fp32 operands on CUDA run on the Triton kernels too, on tensor cores: TF32 where the user allowed TF32
  matmuls (as cuBLAS would), else three TF32 products per tile (``tf32x3``: ``a = a_hi + a_lo`` with
  ``a_hi`` rounded to TF32, ``a_hi b_hi + a_hi b_lo + a_lo b_hi``, the ``a_lo b_lo`` term, about
  ``2^-22`` of each product, dropped), which meets the tolerance rule against cuBLAS's fp32 ``mm``
  (``tests/test_kernel_grouped_mm.py``, on the GPU), on sm_80 and newer. On sm_90 the token operand is
  split once ahead instead (``grouped_mm_split.py``, the same three products, about 1.47x faster there;
  ``fp32_path``). ``OPSMATH_FP32_GROUPED_GEMM=mm`` keeps cuBLAS's fp32 SIMT ``mm`` per group (a host sync
  per call), as do older GPUs and ROCm; HF's grouped experts under autocast take this path.
- Backward: ``dx = grouped(dy, w^T)``; ``dw[g] = x_g^T dy_g``, zero for an empty group, in the weight's
  layout (``weight_grad``: a transposed ``nn.Linear`` stack gets ``(dy_g^T x_g)^T``, no transposing copy).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from opsmath.kernels import grouped_mm_split
from opsmath.kernels._common import first_order_only, launch_precision, next_pow2, tuned_config, use_triton
from opsmath.kernels._spec import OpSpec, backward, leaf, register
from opsmath.kernels.grouped_mm_split import group_of_tile

# Tiles (BM, BN, BK, num_warps, num_stages), the default first (the kernels' first tiles, Triton's default
# warps and stages); the others are the Triton matmul tutorial's for Hopper-class GPUs. Each Triton launch
# measures them once per (GPU, shape bucket) at its first call (``_common.tuned_config``, cached on disk);
# a tile that does not fit a GPU fails its measurement and is left out. Forward: rows x output columns;
# weight gradient: K x N per (group), a loop over the group's rows in steps of BM.
FWD_TILES = {"64x64x32w4s3": (64, 64, 32, 4, 3), "128x128x64w8s3": (128, 128, 64, 8, 3),
             "128x64x64w4s3": (128, 64, 64, 4, 3), "64x128x64w4s3": (64, 128, 64, 4, 3),
             "128x256x64w8s3": (128, 256, 64, 8, 3)}
WGRAD_TILES = {"64x64x32w4s3": (64, 64, 32, 4, 3), "64x128x128w8s3": (64, 128, 128, 8, 3),
               "32x128x128w8s3": (32, 128, 128, 8, 3), "64x64x128w4s3": (64, 64, 128, 4, 3)}


def native(dtype: torch.dtype, k: int, n: int) -> bool:
    """Whether ``torch._grouped_mm`` (forward, backward and its Inductor lowering) takes operands of
    ``dtype`` with inner size ``k`` and output size ``n``: measured on torch 2.11 (CUDA, H200) and 2.13
    (CPU), bf16 with 16-byte aligned rows only (fp16 fails under Inductor, fp32 everywhere)."""
    return dtype == torch.bfloat16 and k % 8 == 0 and n % 8 == 0


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


@triton.jit
def _grouped_fwd(X, W, Offs, Y, K, N, G, sxm, sxk, swg, swk, swn, sym, syn, PRECISION: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GP: tl.constexpr, Rows=None,
                 GATHER: tl.constexpr = False):
    """``Y[r] = X[r] @ W[g]`` for the rows of one row tile, one ``BN`` block of columns; ``GATHER``:
    ``X[Rows[r]]`` (the rows read through an index, ``grouped_gather.py``)."""
    g, end, row0 = group_of_tile(Offs, tl.program_id(0), G, 0, 2147483647, BM, GP)
    if g < G:
        rows, cols = row0 + tl.arange(0, BM), tl.program_id(1) * BN + tl.arange(0, BN)
        rmask, cmask = rows < end, cols < N
        src = rows.to(tl.int64)
        if GATHER:
            src = tl.load(Rows + rows, mask=rmask, other=0).to(tl.int64)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            a = tl.load(X + src[:, None] * sxm + ks[None, :] * sxk,
                        mask=rmask[:, None] & (ks[None, :] < K), other=0.0)
            b = tl.load(W + g.to(tl.int64) * swg + ks[:, None] * swk + cols[None, :] * swn,
                        mask=(ks[:, None] < K) & cmask[None, :], other=0.0)
            acc += tl.dot(a, b, input_precision=PRECISION)
        tl.store(Y + rows[:, None].to(tl.int64) * sym + cols[None, :] * syn, acc.to(Y.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _grouped_wgrad(X, DY, Offs, DW, K, N, sxm, sxk, sdm, sdn, swg, swk, swn, PRECISION: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, Rows=None, GATHER: tl.constexpr = False):
    """``DW[g] = X_g^T DY_g`` for one (group, K block, N block): a loop over the group's rows; ``GATHER``:
    row ``r`` of ``X`` is ``X[Rows[r]]``."""
    g = tl.program_id(0)
    start = tl.load(Offs + g - 1, mask=g > 0, other=0)
    end = tl.load(Offs + g)
    ks, cols = tl.program_id(1) * BK + tl.arange(0, BK), tl.program_id(2) * BN + tl.arange(0, BN)
    kmask, cmask = ks < K, cols < N
    acc = tl.zeros([BK, BN], tl.float32)
    for m0 in range(start, end, BM):
        rows = m0 + tl.arange(0, BM)
        rmask = rows < end
        src = rows.to(tl.int64)
        if GATHER:
            src = tl.load(Rows + rows, mask=rmask, other=0).to(tl.int64)
        a = tl.load(X + src[None, :] * sxm + ks[:, None] * sxk, mask=kmask[:, None] & rmask[None, :], other=0.0)
        b = tl.load(DY + rows[:, None].to(tl.int64) * sdm + cols[None, :] * sdn, mask=rmask[:, None] & cmask[None, :],
                    other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    tl.store(DW + g.to(tl.int64) * swg + ks[:, None] * swk + cols[None, :] * swn, acc.to(DW.dtype.element_ty),
             mask=kmask[:, None] & cmask[None, :])


# The dtypes the Triton kernels take everywhere they run (CUDA; the interpreter when asked): 16-bit. fp32
# takes them on CUDA (``fp32_on_triton``); on CPU it stays one ``mm`` per group unless a test adds it here.
TRITON_DTYPES = (torch.float16, torch.bfloat16)


def fp32_path(x: torch.Tensor) -> str:
    """How fp32 operands on ``x``'s device run where cuBLAS would take fp32 on a GPU with TF32 tensor cores:
    ``split`` (the token operand split ahead, ``grouped_mm_split.py``; the default on sm_90, where it was
    measured: 1.48x compile on HF Mixtral and Qwen2-MoE under AMP, within the tolerance rule), ``tf32x3``
    (Triton's three TF32 products, both operands split in every tile; the default elsewhere), ``mm``
    (cuBLAS's fp32 ``mm`` per group). ``OPSMATH_FP32_GROUPED_GEMM`` picks one."""
    chosen = os.environ.get("OPSMATH_FP32_GROUPED_GEMM")
    if chosen:
        return chosen
    return "split" if x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0) else "tf32x3"


def _split_ahead(x: torch.Tensor) -> bool:
    return precision(x) == "tf32x3" and fp32_path(x) == "split"


def fp32_on_triton(x: torch.Tensor) -> bool:
    """Whether fp32 operands on ``x``'s device run on the Triton kernels (module docstring): on NVIDIA GPUs
    with TF32 tensor cores (sm_80 and newer), unless ``OPSMATH_FP32_GROUPED_GEMM=mm`` asks for cuBLAS's
    per-group fp32 ``mm``. Older GPUs and ROCm keep the per-group ``mm``."""
    if not x.is_cuda or torch.version.hip or fp32_path(x) == "mm":
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 0)


def _on_triton(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not use_triton(x) or x.dtype != w.dtype:
        return False
    return x.dtype in TRITON_DTYPES or (x.dtype == torch.float32 and fp32_on_triton(x))


def precision(x: torch.Tensor):
    """``tl.dot``'s ``input_precision`` for operands like ``x``: ``launch_precision``'s, but on CUDA, where
    cuBLAS would run SIMT fp32, three TF32 products (``tf32x3``: not bitwise fp32, within its tolerance rule)."""
    p = launch_precision(x)
    return "tf32x3" if p == "ieee" and x.is_cuda else p


def fitting(tiles: dict, x: torch.Tensor, wgrad: bool) -> dict:
    """The tiles ``(BM, BN, BK, warps, stages)`` whose pipelined operand buffers fit one block's shared
    memory on ``x``'s GPU: ``(BM BK + BK BN) x element size x stages`` bytes, the weight gradient's
    ``(BK BM + BM BN)``. fp32's forward 128x256x64 tile needs 288 KiB where an sm_90 block has 227 KiB. All
    of them on the CPU."""
    if not x.is_cuda:
        return tiles
    limit = getattr(torch.cuda.get_device_properties(x.device), "shared_memory_per_block_optin", 232448)

    def fits(t):
        bm, bn, bk, _, stages = t
        return (bm * bk + (bm * bn if wgrad else bk * bn)) * x.element_size() * stages <= limit
    return {name: t for name, t in tiles.items() if fits(t)} or tiles


def _tiles(op: str, tiles: dict, x: torch.Tensor, G: int, K: int, N: int, run):
    """The tile ``run`` launches with for this shape bucket (measured: ``_common.tuned_config``)."""
    key = f"{str(x.dtype).replace('torch.', '')} {precision(x)} G={G} K={K} N={N} rows<={next_pow2(x.shape[0])}"
    return tuned_config(op, key, fitting(tiles, x, tiles is WGRAD_TILES), run, x.device)


def grouped_forward_triton(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``y[r] = x[r] @ w[g]`` (``w`` [G, K, N], any strides: ``w.transpose(1, 2)`` computes dx), zeros past
    the last group; no host read of ``offs``."""
    if _split_ahead(x):
        return grouped_mm_split.forward(x, w, offs)
    (S, K), G, N = x.shape, w.shape[0], w.shape[2]
    y = x.new_zeros(S, N)

    def run(tile):
        bm, bn, bk, warps, stages = tile
        _grouped_fwd[(triton.cdiv(S, bm) + G, triton.cdiv(N, bn))](
            x, w, offs, y, K, N, G, *x.stride(), *w.stride(), *y.stride(), PRECISION=precision(x),
            BM=bm, BN=bn, BK=bk, GP=max(16, triton.next_power_of_2(G)), num_warps=warps, num_stages=stages)
    if S and N:
        run(_tiles("grouped_mm_fwd", FWD_TILES, x, G, K, N, run))
    return y


def weight_grad_triton(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``dw[g] = x_g^T dy_g`` ([G, K, N], x's dtype); zero for an empty group."""
    if _split_ahead(x):
        return grouped_mm_split.weight_grad(x, dy, offs)
    G, K, N = offs.shape[0], x.shape[1], dy.shape[1]
    dw = x.new_empty(G, K, N)

    def run(tile):
        bm, bn, bk, warps, stages = tile
        _grouped_wgrad[(G, triton.cdiv(K, bk), triton.cdiv(N, bn))](
            x, dy, offs, dw, K, N, *x.stride(), *dy.stride(), *dw.stride(), PRECISION=precision(x),
            BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    if G and K and N:
        run(_tiles("grouped_mm_wgrad", WGRAD_TILES, x, G, K, N, run))
    return dw


@torch.library.custom_op("opsmath::grouped_mm", mutates_args=())
def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if _on_triton(x, w):
        return grouped_forward_triton(x, w, offs)
    out = x.new_zeros(x.shape[0], w.shape[2])
    for g, (s, e) in enumerate(_bounds(offs)):
        if e > s:
            torch.mm(x[s:e], w[g], out=out[s:e])
    return out


@grouped_mm_loop.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("opsmath::grouped_mm_weight_grad", mutates_args=())
def weight_grad_loop(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``dw[g] = x_g^T dy_g`` ([G, K, N]); zero for an empty group."""
    if _on_triton(x, dy):
        return weight_grad_triton(x, dy, offs)
    dw = x.new_zeros(offs.shape[0], x.shape[1], dy.shape[1])
    for g, (s, e) in enumerate(_bounds(offs)):
        if e > s:
            torch.mm(x[s:e].t(), dy[s:e], out=dw[g])
    return dw


@weight_grad_loop.register_fake
def _(x, dy, offs):
    return x.new_empty(offs.shape[0], x.shape[1], dy.shape[1])


def _setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def weight_grad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``dw[g] = x_g^T dy_g`` [G, K, N]; ``transposed``: laid out as a stack of ``nn.Linear`` weights read
    through ``.transpose(1, 2)`` ([G, N, K] in memory), computed as ``(dy_g^T x_g)^T`` so that the
    parameter's gradient needs no transposing copy (torch's own ``_grouped_mm`` backward matches the
    weight's strides the same way; a mismatched layout costs a strided copy of every expert's gradient).
    ``torch._grouped_mm`` where it takes the operands, else ``opsmath::grouped_mm_weight_grad``."""
    a, b = (dy, x) if transposed else (x, dy)
    if native(a.dtype, a.shape[1], b.shape[1]) and a.dtype == b.dtype:
        out = torch._grouped_mm(a.t(), b, offs=offs)
    else:
        out = weight_grad_loop(a, b, offs)
    return out.transpose(1, 2) if transposed else out


def linear_layout(w: torch.Tensor) -> bool:
    """Whether the [G, K, N] weight ``w`` is a transposed stack of [N, K] matrices (K contiguous)."""
    return w.stride(-2) == 1 and w.stride(-1) != 1


def _backward(ctx, dy):
    first_order_only("experts")
    x, w, offs = ctx.saved_tensors
    dx = grouped_mm_loop(dy, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    dw = weight_grad(x, dy, offs, linear_layout(w)) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm_loop.register_autograd(_backward, setup_context=_setup)


def grouped_op(x_dtype: torch.dtype, w_dtype: torch.dtype, k: int, n: int):
    """The op of the fastest path for operands of these dtypes and sizes: ``aten._grouped_mm`` where
    ``native`` holds (and both operands share the dtype), else ``opsmath::grouped_mm``."""
    if native(x_dtype, k, n) and w_dtype == x_dtype:
        return torch.ops.aten._grouped_mm.default
    return torch.ops.opsmath.grouped_mm.default


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM on the fastest path the operands allow (see the module docstring)."""
    return grouped_op(x.dtype, w.dtype, x.shape[1], w.shape[2])(x, w, offs)


LOAD_STEPS = 16    # calls of each MoE layer whose expert load is kept


class ExpertLoad:
    """Tokens routed to each of ``experts`` experts over the last ``LOAD_STEPS`` calls of one rewritten
    MoE layer: a [LOAD_STEPS, experts] ring of the grouped GEMM's ``offs`` on their device, written by a
    device copy (no host sync) into the slot a device-side call counter names, so that CUDA-graph replays,
    which repeat the captured kernels but not the Python around them, fill successive slots as eager calls
    do; read (one sync) when a report asks."""

    def __init__(self, experts: int, where: str):
        self.experts, self.where, self.ring, self.count = experts, where, None, None

    def record(self, offs: torch.Tensor) -> None:
        if self.ring is None or self.ring.device != offs.device:
            self.ring = torch.zeros(LOAD_STEPS, self.experts, dtype=torch.int32, device=offs.device)
            self.count = torch.zeros((), dtype=torch.int64, device=offs.device)
        slot = torch.remainder(self.count, LOAD_STEPS).reshape(1)
        self.ring.index_copy_(0, slot, offs.reshape(1, -1).to(torch.int32))
        self.count.add_(1)

    @property
    def calls(self) -> int:
        """Calls recorded, replays included (one host sync)."""
        return 0 if self.count is None else int(self.count.item())

    def counts(self) -> torch.Tensor:
        """[n, experts] int64 on the CPU, oldest first: tokens per expert in each of the last n <=
        LOAD_STEPS calls."""
        n = self.calls
        if n == 0:
            return torch.zeros(0, self.experts, dtype=torch.int64)
        ends = self.ring.to("cpu", torch.int64)
        ends = torch.roll(ends, -(n % LOAD_STEPS), 0) if n > LOAD_STEPS else ends[:n]
        return torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1]))


LOADS: list[ExpertLoad] = []


def new_load_site(experts: int, where: str) -> int:
    LOADS.append(ExpertLoad(experts, where))
    return len(LOADS) - 1


@torch.library.custom_op("opsmath::expert_load", mutates_args=())
def expert_load(offs: torch.Tensor, site: int) -> torch.Tensor:
    """``offs`` unchanged (a copy, so that the op is never dead code), recorded for site ``site``."""
    LOADS[site].record(offs)
    return offs.clone()


@expert_load.register_fake
def _(offs, site):
    return torch.empty_like(offs)


def reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group ``x_g @ w[g]`` in fp32, zeros past the last group (what tests compare against)."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float32)
    for g, (s, e) in enumerate(_bounds(offs)):
        out[s:e] = x[s:e].float() @ w[g].float()
    return out


def _flops(x, w, offs):
    return 2.0 * x.shape[0] * x.shape[1] * w.shape[2]


def _exercise(dtype):
    offs = torch.tensor([2, 6], dtype=torch.int32)
    for n in (8, 12):   # bf16: torch._grouped_mm, then (12: unaligned) the Triton kernels; fp32: per group
        x, w = leaf(6, 8, dtype=dtype), leaf(2, 8, n, dtype=dtype)
        backward(grouped_mm(x, w, offs))
    if dtype == torch.float32:   # CUDA's split-ahead fp32 kernels, called as the op calls them there
        x, w = torch.randn(6, 8), torch.randn(2, 12, 8).transpose(1, 2)
        grouped_mm_split.weight_grad(grouped_mm_split.forward(x, w, offs, step=4), x, offs, step=4)   # 2 chunks


def _workspace(x, w, offs):
    return grouped_mm_split.workspace(x, w, offs) if _split_ahead(x) else 0


SPEC = register(OpSpec("experts", ops=(torch.ops.opsmath.grouped_mm.default, torch.ops.aten._grouped_mm.default),
                       flops=_flops, exercise=_exercise, profile=("grouped GEMM", ("grouped", "cutlass")),
                       workspace=_workspace,
                       saves="the sorted token rows and the stacked expert weights"))
