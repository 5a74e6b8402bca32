"""The bytes an optimizer's state will hold, before it exists.

A memory budget must hold at the step's peak, and the optimizer's state appears only at its first
``step()``, after the first step that had to fit. The planner (``opsmath.memory.budget.resident_at_peak``)
asks here what will be resident by then:

* a parameter held by an ``opsmath.optim.AdamW`` (each registers itself in ``LIVE`` when constructed):
  that optimizer's layout, exactly: 8-bit moments, 2 bytes plus two fp32 block maxima per
  ``QBLOCK`` elements (``state_bits=8``); an fp32 master and fp32 moments, 12 bytes, for a 16-bit
  parameter with ``master_weights``; else two moments in the parameter's dtype. Nothing where its state
  already exists (it is in the allocated bytes).
* any other parameter that needs a gradient: ``torch.optim.AdamW``'s two moments in its dtype, assumed.
  It is the common case and the larger of the usual ones (SGD with momentum holds one moment, plain SGD
  none); a smaller state leaves slack that the plan spends from the second step on
  (``opsmath.memory.replan``). A resumed optimizer whose state was loaded before the first call is
  counted twice at the first step, for the same reason harmlessly.

The ``step`` counters (one scalar per parameter) are left out.
"""
from __future__ import annotations

import weakref

import torch

from opsmath.kernels.adamw_8bit import QBLOCK

LIVE: "weakref.WeakSet" = weakref.WeakSet()


def _numel(p: torch.Tensor) -> int:
    """Elements of ``p`` on this rank (an FSDP2 ``DTensor`` counts its local shard)."""
    return (p.to_local() if hasattr(p, "to_local") else p).numel()


def layout_bytes(p: torch.Tensor, group: dict) -> int:
    """State bytes opsmath's AdamW allocates for ``p`` under ``group``'s settings."""
    n = _numel(p)
    if group.get("state_bits", 32) == 8:
        return 2 * n + 2 * 4 * -(-n // QBLOCK)
    if group.get("master_weights", False) and p.dtype != torch.float32:
        return 12 * n
    return 2 * n * p.element_size()


def state_to_come(params) -> tuple[int, int]:
    """``(bytes, assumed)``: the optimizer state the first ``step()`` will allocate for ``params``, and
    the part of it assumed (parameters no opsmath optimizer holds: AdamW's two moments)."""
    owner = {id(p): (opt, g) for opt in list(LIVE) for g in opt.param_groups for p in g["params"]}
    total = assumed = 0
    for p in params:
        if not (isinstance(p, torch.Tensor) and p.requires_grad):
            continue
        hit = owner.get(id(p))
        if hit is None:
            n = 2 * _numel(p) * p.element_size()
            total, assumed = total + n, assumed + n
        elif not dict.get(hit[0].state, p):   # a defaultdict: ``get`` creates nothing
            total += layout_bytes(p, hit[1])
    return total, assumed
