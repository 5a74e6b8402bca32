"""``opsmath::table_gather``: rows of a small table read by many indices (``F.embedding(idx, table)`` where
``idx`` has far more entries than ``table`` has rows), with a backward that sums each row's gradient
without atomics.

Math. ``table`` (R, C), ``idx`` (...) of ints in [0, R)::

    y[p, :]     = table[idx[p], :]                          y: (..., C), the table's dtype
    dtable[r, :] = sum over p with idx[p] == r of dy[p, :]   fp32 sums, returned in the table's dtype

Where it pays: T5's relative position bias, ``Embedding(32 buckets, heads)`` looked up at every (query, key)
pair, 262144 indices into 32 rows at sequence 512. Eager and Inductor scatter each gradient row into the
table with an atomic add, and the adds of one warp mostly hit one row (neighbouring pairs share a bucket):
contended atomics, several milliseconds a step. Here each program takes ``BN`` indices and ``BC`` columns
and forms the partial sums of all R rows at once as a product ``onehot(idx)^T @ dy`` (fp32, exact
products: each is ``dy`` times 1 or 0), written to its own slot; the slots are summed afterwards. Nothing
is contended and the result is deterministic.

Shapes: R <= ``MAX_ROWS``. Caveats: indices outside [0, R) raise in the forward (PyTorch's embedding
check); ``padding_idx``, ``scale_grad_by_freq`` and sparse gradients are not supported (the pattern keeps
those embeddings as they are).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opsmath.kernels._common import first_order_only, use_triton
from opsmath.kernels._spec import OpSpec, backward, register

MAX_ROWS = 1024     # rows of the one-hot product per program, in chunks of BR
_BN, _BC = 128, 32


def _rows(r: int) -> int:
    """The row chunk of the one-hot product: R rounded up to a power of two, 16 to 64."""
    return min(64, max(16, triton.next_power_of_2(r)))


@triton.jit
def _partial_sums(idx_ptr, dy_ptr, out_ptr, N, C, R, stride_dy, BN: tl.constexpr, BC: tl.constexpr,
                  BR: tl.constexpr):
    """``out[pid_n, r, c] = sum over this program's p with idx[p] == r of dy[p, c]`` for every r < R."""
    pid_n, pid_c = tl.program_id(0), tl.program_id(1)
    p = pid_n * BN + tl.arange(0, BN)
    c = pid_c * BC + tl.arange(0, BC)
    pm, cm = p < N, c < C
    rows = tl.load(idx_ptr + p, mask=pm, other=-1)
    g = tl.load(dy_ptr + p[:, None].to(tl.int64) * stride_dy + c[None, :], mask=pm[:, None] & cm[None, :],
                other=0.0).to(tl.float32)
    base = out_ptr + pid_n.to(tl.int64) * R * C
    for r0 in range(0, R, BR):
        r = r0 + tl.arange(0, BR)
        onehot = (rows[None, :] == r[:, None]).to(tl.float32)                  # (BR, BN)
        part = tl.dot(onehot, g, input_precision="ieee")                       # (BR, BC), fp32
        tl.store(base + r[:, None] * C + c[None, :], part, mask=(r[:, None] < R) & cm[None, :])


def backward_triton(dy: torch.Tensor, idx: torch.Tensor, rows: int) -> torch.Tensor:
    """fp32 (rows, C) sums of ``dy`` (N, C) by ``idx`` (N,): per-program partial sums, then their sum."""
    N, C = dy.shape
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    grid = (triton.cdiv(N, _BN), triton.cdiv(C, _BC))
    parts = torch.empty((grid[0], rows, C), device=dy.device, dtype=torch.float32)
    if N and C and rows:
        _partial_sums[grid](idx.contiguous(), dy, parts, N, C, rows, dy.stride(0), BN=_BN, BC=_BC,
                            BR=_rows(rows), num_warps=4)
    return parts.sum(0) if N else torch.zeros((rows, C), device=dy.device, dtype=torch.float32)


def backward_reference(dy: torch.Tensor, idx: torch.Tensor, rows: int) -> torch.Tensor:
    """fp32 (rows, C) sums of ``dy`` (N, C) by ``idx`` (N,) (``index_add_``: what eager's backward does)."""
    out = torch.zeros((rows, dy.shape[1]), device=dy.device, dtype=torch.float32)
    return out.index_add_(0, idx, dy.float())


def _check(table: torch.Tensor, idx: torch.Tensor) -> None:
    if table.dim() != 2 or idx.dtype not in (torch.int32, torch.int64) or table.shape[0] > MAX_ROWS:
        raise ValueError(f"opsmath::table_gather takes a 2-D table of at most {MAX_ROWS} rows and integer "
                         f"indices, got {table.dtype}{tuple(table.shape)} and {idx.dtype}{tuple(idx.shape)}")


@torch.library.custom_op("opsmath::table_gather", mutates_args=())
def table_gather_op(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    _check(table, idx)
    return torch.nn.functional.embedding(idx, table).contiguous()


@table_gather_op.register_fake
def _(table, idx):
    _check(table, idx)
    return table.new_empty((*idx.shape, table.shape[1]))


@torch.library.custom_op("opsmath::table_gather_backward", mutates_args=())
def table_gather_backward_op(dy: torch.Tensor, idx: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    flat_dy, flat_idx = dy.reshape(-1, dy.shape[-1]), idx.reshape(-1)
    sums = backward_triton(flat_dy, flat_idx, rows) if use_triton(dy) else backward_reference(flat_dy, flat_idx, rows)
    return sums.to(dtype)


@table_gather_backward_op.register_fake
def _(dy, idx, rows, dtype):
    return dy.new_empty((rows, dy.shape[-1]), dtype=dtype)


def _setup_context(ctx, inputs, output):
    table, idx = inputs
    ctx.save_for_backward(idx)
    ctx.rows, ctx.dtype = table.shape[0], table.dtype


def _backward(ctx, dy):
    first_order_only("table_gather")
    idx, = ctx.saved_tensors
    return table_gather_backward_op(dy, idx, ctx.rows, ctx.dtype), None


table_gather_op.register_autograd(_backward, setup_context=_setup_context)


def table_gather(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``F.embedding(idx, table)``; see the module docstring."""
    return table_gather_op(table, idx)


# --------------------------------------------------------------------------------------------------
# Op spec (src/opsmath/kernels/_spec.py)
# --------------------------------------------------------------------------------------------------


def _exercise(dtype: torch.dtype) -> None:
    table = torch.randn(5, 3, dtype=dtype).requires_grad_()
    backward(table_gather(table, torch.randint(0, 5, (7, 9))))


SPEC = register(OpSpec("table_gather", ops=(torch.ops.opsmath.table_gather.default,), exercise=_exercise,
                       saves="the indices"))
