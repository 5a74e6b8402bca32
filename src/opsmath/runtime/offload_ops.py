"""The copies of an offloaded activation, as four custom ops that run them on a transfer stream.

Forward, for a saved tensor ``x`` after its last forward use::

    h = opsmath::offload_start(x)      # pinned host buffer; D2H copy queued on the transfer stream
    opsmath::offload_wait(h, x)        # later: the compute stream waits for the copy; x may be freed after

Backward, for the host buffer ``h`` before its first backward use::

    y = opsmath::reload_start(h, after, size, stride)   # device buffer; H2D copy queued on the transfer stream
    opsmath::reload_wait(y)                             # at the first use: the compute stream waits for it

Between ``*_start`` and ``*_wait`` the copy overlaps the compute the graph puts there (``offload_async``
places them). Ordering and lifetimes, the only things that make this safe:

- The transfer stream waits for the compute stream at each ``*_start`` (``x`` was written there; ``y``'s
  memory came from the compute stream's pool and may still be read by kernels queued before).
- ``x`` stays allocated until the compute stream has waited for its copy; only then can its memory be
  reused (no ``record_stream``, no freed-too-early block). In Inductor's graphs, ``offload_start``'s lowering
  (``lowerings``) makes ``x`` the one buffer ``offload_wait`` reads too, outside Inductor's buffer reuse (by
  default a pointwise ``x`` was computed into a buffer per op and the copied one freed at once). Here, the
  source is also referenced until the wait, for a caller that drops it earlier. ``offload_wait``
  declares that it writes ``h`` and ``reload_wait`` that it writes ``y``: the compiler can neither drop
  them nor move a reader of ``y`` above the wait.
- Pinned buffers are opsmath's own (``PinnedBuffers``): allocated once per size and handed out again once no
  tensor refers to them (a view saved in an autograd graph counts). A buffer's next copy queues on the same
  transfer stream as its last one, so it never overtakes it. PyTorch's caching host allocator, used per copy,
  stalled a traced LLaMA step on a 56 ms ``cudaHostAlloc`` of a block it had not yet taken back
  (``results/profile_offload-llama-h100-20261206.*``).

Each copy's completion event and source are kept by its buffer's ``data_ptr`` between start and wait. Off
CUDA (CPU tests) the ops are plain copies and the waits do nothing.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch.library import custom_op
from torch.multiprocessing.reductions import StorageWeakRef

_streams: dict = {}    # device -> its transfer stream
_lowered = [False]     # ``lowerings()`` ran
_pending: dict = {}    # data_ptr of a buffer being copied -> (the copy's completion event, its source)


class PinnedBuffers:
    """Host buffers by byte size, reused when unreferenced: ``take(shape, dtype)`` returns a view of a free one
    or of a new one (pinned where ``pin``). Free means no tensor but the pool's own holds its storage,
    counted through a weak reference (``torch._C._storage_Use_Count``), so a reference held by C++ (a
    tensor saved for backward) keeps it taken."""

    def __init__(self, pin: bool = True):
        self.pin = pin
        self.by_size: dict[int, list] = {}   # bytes -> [(buffer, weak ref to its storage, use count when free)]

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        slots = self.by_size.setdefault(nbytes, [])
        for buf, ref, free in slots:
            if torch._C._storage_Use_Count(ref.cdata) <= free:
                return buf.view(dtype).view(shape)
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        ref = StorageWeakRef(buf.untyped_storage())
        slots.append((buf, ref, torch._C._storage_Use_Count(ref.cdata)))
        return buf.view(dtype).view(shape)


_pinned = PinnedBuffers()


def _transfer(device: torch.device) -> torch.cuda.Stream:
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device=device)
    return _streams[device]


def _copy_on_transfer(dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> None:
    """``dst.copy_(src)`` on ``device``'s transfer stream, after the work queued so far on the current
    stream; its completion event, and ``src`` (alive until ``_wait``), are kept under ``dst.data_ptr()``."""
    side, current = _transfer(device), torch.cuda.current_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    key = dst.data_ptr()
    _pending[key] = (done, src)
    weakref.finalize(dst, _pending.pop, key, None)   # a graph that raised before the wait: drop the source


def _wait(buf: torch.Tensor, device: torch.device) -> None:
    done, _src = _pending.pop(buf.data_ptr(), (None, None))
    if done is not None:   # the compute stream waits; ``_src`` goes back to the allocator after, in stream order
        torch.cuda.current_stream(device).wait_event(done)


@custom_op("opsmath::offload_start", mutates_args=())
def offload_start(x: torch.Tensor) -> torch.Tensor:
    """A host copy of ``x`` (contiguous, pinned when ``x`` is on CUDA), queued on the transfer stream."""
    if not x.is_cuda:
        return x.to("cpu", copy=True).contiguous()
    h = _pinned.take(x.shape, x.dtype)
    _copy_on_transfer(h, x, x.device)
    return h


@offload_start.register_fake
def _(x):
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@custom_op("opsmath::offload_wait", mutates_args=("h",))
def offload_wait(h: torch.Tensor, x: torch.Tensor) -> None:
    """The compute stream waits until ``h`` holds ``x`` (then ``x``'s memory may be reused)."""
    if x.is_cuda:
        _wait(h, x.device)


@offload_wait.register_fake
def _(h, x):
    return None


@custom_op("opsmath::reload_start", mutates_args=())
def reload_start(h: torch.Tensor, after: torch.Tensor, size: list[int], stride: list[int],
                 device: torch.device) -> torch.Tensor:
    """``h`` back on ``device`` with the saved tensor's ``size`` and ``stride``, queued on the transfer
    stream. ``after`` only orders the op: it is issued once ``after`` is computed."""
    y = torch.empty_strided(size, stride, dtype=h.dtype, device=device)
    if y.is_cuda:
        _copy_on_transfer(y, h.view(size), y.device)
    else:
        y.copy_(h.view(size))
    return y


@reload_start.register_fake
def _(h, after, size, stride, device):
    return torch.empty_strided(size, stride, dtype=h.dtype, device=device)


@custom_op("opsmath::reload_wait", mutates_args=("y",))
def reload_wait(y: torch.Tensor) -> None:
    """The compute stream waits until ``y`` holds its reloaded values."""
    if y.is_cuda:
        _wait(y, y.device)


@reload_wait.register_fake
def _(y):
    return None


def lowerings() -> None:
    """Inductor's lowering of ``offload_start`` (once per process; ``offload_async.place`` calls it before the
    graphs that use it are lowered): its input realized as one buffer, the one ``offload_wait`` reads too
    (by default a pointwise input is computed into a buffer per op), and kept out of Inductor's buffer reuse,
    so no kernel of the graph writes it while the copy reads it."""
    if _lowered[0]:
        return
    from torch._inductor.lowering import fallback_handler, register_lowering
    from torch._inductor.virtualized import V
    op = torch.ops.opsmath.offload_start.default
    fallback = fallback_handler(op, add_to_fallback_set=False)

    @register_lowering(op, type_promotion_kind=None)
    def _(x):
        try:
            x.realize()
            V.graph.never_reuse_buffers.add(x.get_name())
        except (AttributeError, NotImplementedError):   # an input with no buffer of its own: ``_pending`` holds it
            pass
        return fallback(x)
    _lowered[0] = True
