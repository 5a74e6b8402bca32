"""The optimizer step inside backward (``opsmath.optim.AdamW(..., in_backward=True)``).

Each parameter is updated as soon as its gradient is final (a post-accumulate-grad hook) and its
``.grad`` is freed, so the full set of gradients never exists: a step's peak loses up to the gradient
bytes (one parameter copy in the parameters' dtype). Parameters whose gradients arrive close together
share a launch: they wait in a bucket of at most ``bucket_bytes`` of gradients, launched when it is full
and at the end of the backward (an autograd engine callback), so the gradients alive at once stay within
about one bucket.

Where gradients arrive one by one (op by op, or a step of several graphs) the saving is real. A graph
compiled by Inductor returns every gradient of its backward at once, so ``opsmath.optimize`` splits a
model stepped this way into one graph per block (``runtime/blocks.py``): HF LLaMA 1.1B, AMP, on the
H200, the step peak fell from 3.35 to 2.35 GiB at B1 T512 (the host-bound step took longer: 16 graphs)
and from 11.69 to 11.22 GiB at B4 T2048, where activations set the peak (BENCHMARKS.md).

The update of each parameter is AdamW's with the gradient it has at that moment, so a backward followed
by ``step()`` equals ``torch.optim.AdamW``'s step exactly (the same kernels or reference ops). What needs
every gradient before any update cannot be kept, and raises instead of training differently:

- ``max_grad_norm`` (the global norm exists only after the whole backward): a ``ValueError`` at
  construction;
- gradient accumulation (several ``backward()`` per ``step()``): each backward already stepped, so the
  first ``step()`` after more than one backward raises a ``RuntimeError``;
- ``GradScaler``: its inf check reads gradients that were already applied and freed; ``step()`` raises;
- a ``clip_grad_norm_`` or any read of ``p.grad`` between backward and ``step()`` sees ``None``.
"""
from __future__ import annotations

import torch


class InBackward:
    """The hooks and the pending bucket of one optimizer; ``stepper(entries)`` updates ``[(group index,
    parameter)]`` with their current gradients."""

    def __init__(self, stepper, bucket_bytes: int):
        self.stepper, self.bucket_bytes = stepper, bucket_bytes
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.pending_bytes = 0
        self.flush_queued = False
        self.backwards = 0          # backward passes that stepped since the last step()
        self.handles: list = []

    def watch(self, group_index: int, params) -> None:
        for p in params:
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(group_index)))

    def _hook(self, group_index: int):
        def hook(p: torch.Tensor) -> None:
            if not self.flush_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
                self.flush_queued = True
            self.pending.append((group_index, p))
            self.pending_bytes += p.grad.numel() * p.grad.element_size()
            if self.pending_bytes >= self.bucket_bytes:
                self.flush()
        return hook

    def flush(self) -> None:
        if not self.pending:
            return
        entries, self.pending, self.pending_bytes = self.pending, [], 0
        with torch.no_grad():
            self.stepper(entries)
        for _, p in entries:
            p.grad = None

    def end_of_backward(self) -> None:
        self.flush()
        self.flush_queued = False
        self.backwards += 1

    def check_step(self, optimizer) -> None:
        """At ``step()``: every backward since the last one stepped already; more than one is accumulation."""
        backwards, self.backwards = self.backwards, 0
        if getattr(optimizer, "grad_scale", None) is not None:
            raise RuntimeError("opsmath.optim.AdamW(in_backward=True) cannot run under torch.amp.GradScaler: "
                               "its inf check reads gradients that were already applied and freed; use "
                               "bf16 autocast (no scaler) or in_backward=False")
        if backwards > 1:
            raise RuntimeError(f"opsmath.optim.AdamW(in_backward=True) stepped in each of {backwards} backward "
                               "passes since the last step(): gradient accumulation needs the summed "
                               "gradients, which in_backward never keeps; use in_backward=False to accumulate")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
