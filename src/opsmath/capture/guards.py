"""Guards on the buffers a rewrite read at capture.

A matcher may read a module buffer's *value* (nanoGPT's causal ``tril`` mask becomes ``is_causal=True``,
a window mask becomes ``window=w``): the rewritten graph then no longer depends on that buffer, and a
later in-place change (``model.bias.fill_(1)``, a mask swapped for a longer context) would be ignored.
Dynamo does not guard on buffer values (they are graph inputs), so opsmath does.

Per call, each read buffer's identity (``data_ptr``) and version counter (``_version``, bumped by every
in-place write) are compared with those seen at capture: two integer reads per buffer. Only when one
moved is the value checked, against a SHA-256 digest of the bytes taken at capture (no copy of the
buffer is kept: a long-context mask is large). An unchanged value (a checkpoint reloaded with
``load_state_dict``) just refreshes the recorded version; a changed one recaptures the graph with the
new value, or, where the graph cannot be recaptured with the call's inputs (symbolic sizes), runs the
graph as written from then on. Either way the report says so.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Callable, Optional

import torch

log = logging.getLogger("opsmath")


class ReadTracking(dict):
    """A ``dict`` of placeholder name -> buffer that records which values were read (``[]``/``get``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.read.add(key)
        return value

    def get(self, key, default=None):
        if key in self:
            return self[key]
        return default


def digest(t: torch.Tensor) -> bytes:
    """SHA-256 of a tensor's dtype, shape and bytes (row-major)."""
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    flat = t.detach().reshape(-1).contiguous().cpu()
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.digest()


def _stamp(t) -> Optional[tuple]:
    """``(data_ptr, _version)``, or None for what has no version counter (an inference tensor)."""
    try:
        return (t.data_ptr(), t._version)
    except (RuntimeError, AttributeError):
        return None


class BufferGuard:
    """The buffers at ``positions`` of a graph's inputs (``names`` for messages), as ``args`` had them."""

    def __init__(self, positions: list[int], names: list[str], args: list):
        self.positions, self.names = positions, names
        self.stamps = [_stamp(args[i]) for i in positions]
        self.digests = [digest(args[i]) for i in positions]

    def changed(self, args) -> list[str]:
        """Names of the guarded buffers whose value differs from capture's (empty: all the same)."""
        out = []
        for k, i in enumerate(self.positions):
            stamp = _stamp(args[i])
            if stamp is not None and stamp == self.stamps[k]:
                continue
            if isinstance(args[i], torch.Tensor) and digest(args[i]) == self.digests[k]:
                self.stamps[k] = stamp    # written with the same value (a reloaded checkpoint)
                continue
            out.append(self.names[k])
        return out


def guarded(run: Callable, guard: Optional[BufferGuard], on_change: Callable[[list, list[str]], Callable]):
    """``run`` behind ``guard``: when a guarded buffer changed, ``on_change(args, names)`` gives the
    callable used from then on (a recaptured graph, or the graph as written)."""
    if guard is None or not guard.positions:
        return run
    current = [run]

    def call(*args):
        names = guard.changed(args)
        if names:
            current[0], guard.positions = on_change(list(args), names), []
        return current[0](*args)
    return call


def after_change(state, index: int, names: list[str], as_written: Callable, recapture: Optional[Callable] = None):
    """What graph ``index`` runs once the buffers ``names`` changed: ``recapture()`` (the graph captured
    again with the new values), or ``as_written`` (dynamo's graph unchanged) where it cannot be
    recaptured from one call's inputs (symbolic sizes). Logged and added to the report."""
    what = ", ".join(f"`{n}`" for n in names)
    then = f"captured again as graph {len(state.graphs)}" if recapture is not None else "running the graph as written"
    fn = recapture() if recapture is not None else as_written
    msg = f"graph {index}: buffer {what} changed after capture; {then}"
    log.warning("opsmath: %s", msg)
    state.fallback_errors.append(msg)
    return fn
