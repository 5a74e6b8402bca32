"""Plumbing shared by every opsmath kernel.

Dropout randomness
------------------
Fused kernels never store a dropout mask: the mask is a pure function of a 31-bit ``seed`` and the
element's flat ``offset`` (int64), so backward regenerates exactly the mask forward used. The function
is two rounds of MurmurHash3's 32-bit finalizer (``fmix32``)::

    key = fmix32(seed + hi(offset) * 0x9E3779B9)
    h   = fmix32(lo(offset) ^ key)
    u   = (h >> 8) * 2**-24            # uniform in [0, 1), 24 bits
    keep = u >= p

The seed lives in device memory (``new_seeds``) and kernels ``tl.load`` it (``seed_arg``), so a CUDA
graph replays with fresh masks. The hash is written twice, once with torch integer ops
(``dropout_keep``: the CPU reference and the tests) and once in Triton (``keep_mask`` below); both
produce bit-identical masks, which is what lets the tests compare the Triton kernels against the
reference with dropout switched on.

Dispatch
--------
CUDA tensors go to Triton; CPU tensors go to the PyTorch reference. ``OPSMATH_TRITON_ON_CPU=1`` (with
``TRITON_INTERPRET=1``) sends CPU tensors through the Triton kernels, which is how CI tests them.
"""
from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from opsmath.kernels.autotune import cached, pick

_M32 = 0xFFFFFFFF


def first_order_only(family: str) -> None:
    """Refuse a backward that records a graph of itself (grad mode on: ``backward(create_graph=True)`` or
    ``autograd.grad(..., create_graph=True)``, as gradient penalties and meta-learning ask). A fused op's
    gradient comes from kernels, or from results its forward saved, with no derivative of its own: a
    second derivative through it would be missing or wrong. A first-order backward runs with grad mode off."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"opsmath: the fused {family} op's gradient has no derivative, and this backward asks "
                           f"for one (create_graph=True: a gradient penalty, double backward). Leave the family to "
                           f"eager: optimize(model, skip=[{family!r}]), or every family: patterns=[].")


def tf32_matmuls() -> bool:
    """Whether fp32 CUDA matmuls may run in TF32, as cuBLAS would: the matmul setting of the new API
    (``torch.backends.cuda.matmul.fp32_precision``, which also reflects the legacy ``allow_tf32``), then the
    global ``torch.backends.fp32_precision``. The legacy flag is read only on a torch without the new API:
    once anything set the new one (HF Trainer / Accelerate do), reading ``allow_tf32`` raises."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:
        return bool(matmul.allow_tf32)
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision == "tf32"


def launch_precision(t: torch.Tensor):
    """``tl.dot``'s ``input_precision`` for operands like ``t``: fp32 exact ("ieee") unless the user allowed
    TF32 matmuls, as cuBLAS would; 16-bit: Triton's default (the option only concerns fp32)."""
    if t.dtype != torch.float32:
        return None
    return "tf32" if t.is_cuda and tf32_matmuls() else "ieee"


_TRACED = (torch._subclasses.FakeTensor, torch._subclasses.functional_tensor.FunctionalTensor)


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel should run for a tensor on ``t``'s device. Triton's interpreter (CPU)
    cannot run on fake or functional tensors: a ``triton_op`` traced there takes the reference, whose
    outputs have the same shapes and dtypes."""
    if t.is_cuda:
        return True
    return os.environ.get("OPSMATH_TRITON_ON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1" \
        and not isinstance(t, _TRACED)


def traced_on_cuda(op) -> None:
    """Keep a ``torch.library.triton_op`` opaque where its Triton kernels do not run. AOTAutograd traces
    into a ``triton_op`` (its FunctionalTensorMode rule), so that Inductor launches the kernels from its
    own code; on CPU the function computes the PyTorch reference instead, and traced into, its
    intermediates (attention's S x S scores) would become values Inductor saves for backward. There it
    stays one op, as a custom op would."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    decompose = op._torch_dispatch_fns[FunctionalTensorMode]

    def rule(mode, func, types, args, kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and all(t.is_cuda for t in tensors):
            return decompose(mode, func, types, args, kwargs)
        return mode.__torch_dispatch__(func, types, args, kwargs)
    op.register_torch_dispatch(FunctionalTensorMode, rule)


def new_seeds(like: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` fresh dropout seeds (int64, shape ``(n,)``) on ``like``'s device, drawn from that device's
    generator, so ``torch.manual_seed``, checkpoint's RNG preservation and AOTAutograd's RNG
    functionalization govern them. A rewritten graph draws all its seeds with one call
    (``match.batch_seeds``) and hands each fused op a one-element view."""
    return torch.randint(0, 2**31 - 1, (n,), dtype=torch.int64, device=like.device)


def new_seed(like: torch.Tensor) -> torch.Tensor:
    """One fresh dropout seed, an int64 scalar tensor on ``like``'s device (see :func:`new_seeds`)."""
    return new_seeds(like, 1)[0]


def check_seed(op: str, dropout_p: float, seed) -> None:
    """A fused op with dropout needs its seed; without dropout it takes None."""
    if dropout_p > 0 and seed is None:
        raise ValueError(f"opsmath::{op} with dropout_p={dropout_p} needs a seed tensor "
                         "(opsmath.kernels._common.new_seed(x) draws one)")


def seed_arg(seed, like: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """What a kernel's ``Seed`` pointer receives. Kernels load the seed from memory when they run,
    never take it as a launch argument: a CUDA graph captured around them replays with whatever the
    seed tensor holds at replay (a fresh draw each step), where a baked-in integer would repeat one
    dropout mask forever. Without dropout the kernel never reads it and ``like`` is passed as is; a
    Python int or a seed on another device (direct callers, tests) is copied to ``like``'s device."""
    if dropout_p <= 0:
        return like
    if not isinstance(seed, torch.Tensor):
        seed = torch.tensor(int(seed), dtype=torch.int64)
    return seed.to(device=like.device, dtype=torch.int64)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    # (h * c) mod 2**32 without overflowing int64: split c into 16-bit halves.
    lo = h * (c & 0xFFFF)
    hi = ((h * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def dropout_keep(seed, offsets: torch.Tensor, p: float) -> torch.Tensor:
    """Boolean keep-mask for int64 ``offsets`` (any shape): True where the element survives dropout.
    ``seed``: an int, or a one-element int64 tensor (read on the device, so that a traced reference
    never reads it on the host)."""
    offsets = offsets.to(torch.int64)
    lo = offsets & _M32
    hi = (offsets >> 32) & _M32
    if isinstance(seed, torch.Tensor):
        seed = seed.to(device=offsets.device, dtype=torch.int64).reshape(())
    key = _fmix32((_mul32(hi, 0x9E3779B9) + seed) & _M32)
    h = _fmix32(lo ^ key)
    u = (h >> 8).to(torch.float32) * (2.0**-24)
    return u >= p


def flat_offsets(shape, device) -> torch.Tensor:
    """Row-major int64 offsets of every element of a tensor of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, device=device, dtype=torch.int64).view(shape)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


ROW_TILE = 4096   # elements a row-wise kernel moves per tensor per step: narrower rows go several at a time
_FORCED_ROW: list = [None]   # index of the configuration every row-kernel launch uses (forced_row_config)


class forced_row_config:
    """``with forced_row_config(i):`` row-kernel launches use candidate ``i`` (modulo their count) of
    ``tuned_config``'s configurations: how a test reaches every configuration the tuner may pick."""

    def __init__(self, index: int):
        self.index = index

    def __enter__(self):
        self.prev, _FORCED_ROW[0] = _FORCED_ROW[0], self.index

    def __exit__(self, *exc):
        _FORCED_ROW[0] = self.prev


def tuned_config(op: str, key: str, configs: dict, run, device: torch.device):
    """The launch configuration of a row-wise kernel for one shape bucket, chosen by measurement.

    ``configs`` maps a name to a configuration, the default first; ``run(config)`` launches the kernel
    once on the caller's tensors (writing only outputs the real launch overwrites). On a GPU each
    configuration is timed once per (GPU, torch/triton versions, ``op``, ``key``) through
    ``autotune.pick`` and the winner is kept on disk, so later processes launch it without
    measuring. Under the interpreter, while a CUDA graph is being captured (nothing may be timed) or with
    ``OPSMATH_TUNE_KERNELS=0`` the cached choice, else the default, is used. Why measure: on the H200 one
    tile shape was the fastest of the candidates at some (dtype, width) and 30% slower at others
    (BENCHMARKS.md, 2026-11-29)."""
    names = list(configs)
    default = configs[names[0]]
    if _FORCED_ROW[0] is not None:
        return configs[names[_FORCED_ROW[0] % len(names)]]
    if len(names) == 1 or device.type != "cuda":
        return default
    if torch.cuda.is_current_stream_capturing() or os.environ.get("OPSMATH_TUNE_KERNELS") == "0":
        return configs.get(cached(op, key), default)
    try:
        # each rank keeps its own choice (no collective: this may run inside backward); a launch
        # configuration changes only the order of the fp32 partial sums, not what is computed
        return configs[pick(op, key, {name: (lambda c=c: run(c)) for name, c in configs.items()}, sync=False)]
    except Exception as e:   # tuning must never stop training: the default configuration is always valid
        logging.getLogger("opsmath").warning("opsmath: tuning %s [%s] failed (%s); using the default", op, key, e)
        return default


def programs_per_sm(regs: int, shared: int, warps: int, regs_per_sm: int = 65536, shared_per_sm: int = 232448,
                    warp_size: int = 32) -> int:
    """Programs of ``warps`` warps, each thread holding ``regs`` registers and the program ``shared``
    bytes of shared memory, that fit on one SM at once (defaults: the H200's sm_90; 64 warp slots, at
    most 32 resident blocks)."""
    by_regs = regs_per_sm // max(1, regs * warp_size * warps)
    by_smem = shared_per_sm // shared if shared else by_regs
    return max(1, min(by_regs, by_smem, 64 // warps, 32))


def resident_programs(kernel, grid_args: tuple, launch_kwargs: dict, device: torch.device, fallback: int = 4) -> int:
    """How many programs of a Triton ``kernel``, launched as ``kernel[grid](*grid_args, **launch_kwargs)``,
    fit on one SM at once: the SM's registers, shared memory and warp slots over one program's use, read
    off the compiled kernel (``kernel.warmup``; the way Triton's fused-softmax tutorial sizes its persistent
    grid). A persistent kernel launched with this many programs per SM runs in one wave, every SM full.
    ``fallback`` when it cannot be read (the interpreter, another backend)."""
    if device.type != "cuda":
        return fallback
    try:
        from triton.runtime import driver
        props = driver.active.utils.get_device_properties(device.index if device.index is not None
                                                          else torch.cuda.current_device())
        compiled = kernel.warmup(*grid_args, grid=(1,), **launch_kwargs)
        compiled._init_handles()
        return programs_per_sm(compiled.n_regs, compiled.metadata.shared, launch_kwargs.get("num_warps", 4),
                               props["max_num_regs"], props["max_shared_mem"], props["warpSize"])
    except Exception as e:   # an estimate only: the caller's other launch configurations still work
        logging.getLogger("opsmath").debug("opsmath: occupancy of %s unknown (%s)",
                                           getattr(kernel, "__name__", kernel), e)
        return fallback


def row_key(x: torch.Tensor, N: int, *flags: str) -> str:
    """A row kernel's tuning key: dtype, width, the row count rounded up to a power of two (rows of one
    bucket share a configuration) and the kernel's own ``flags``."""
    return " ".join((str(x.dtype).removeprefix("torch."), f"N={N}",
                     f"M<={next_pow2(max(x.numel() // N, 1))}", *flags))


def row_tile(N: int, max_block_n: int | None = None) -> tuple[int, int]:
    """(TILE_M, BLOCK_N) for rows of width N: BLOCK_N covers the row (capped at ``max_block_n`` when the
    kernel loops over column blocks), TILE_M rows per step so a tile holds about ``ROW_TILE`` elements
    (enough bytes in flight per program; one narrow row at a time is not)."""
    block_n = next_pow2(N) if max_block_n is None else min(max_block_n, next_pow2(N))
    return max(1, ROW_TILE // block_n), block_n


@triton.jit
def _fmix32_tl(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def load_seed(Seed, HAS_DROPOUT: tl.constexpr):
    """The dropout seed a kernel reads from its ``Seed`` pointer at run time (see ``seed_arg``); 0, and
    no read, without dropout."""
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    return seed


@triton.jit
def keep_mask(seed, offsets, p):
    """Triton twin of :func:`dropout_keep`: ``offsets`` is an int64 block, ``seed`` an integer (the value
    loaded from the kernel's ``Seed`` pointer)."""
    lo = (offsets & 0xFFFFFFFF).to(tl.uint32)
    hi = ((offsets >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _fmix32_tl(hi * 0x9E3779B9 + seed.to(tl.uint32))
    h = _fmix32_tl(lo ^ key)
    u = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
    return u >= p
