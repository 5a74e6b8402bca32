"""The bytes an optimizer's state will hold, before it exists.

A memory budget must hold at the step's peak, and the optimizer's state appears only at its first
``step()``, after the first step that had to fit. The planner (``opsmath.memory.budget.resident_at_peak``)
asks here what will be resident by then:

* a parameter held by an ``opsmath.optim.AdamW`` (each registers itself in ``LIVE`` when constructed):
  that optimizer's layout, exactly: 8-bit moments, 2 bytes plus two fp32 block maxima per
  ``QBLOCK`` elements (``state_bits=8``); an fp32 master and fp32 moments, 12 bytes, for a 16-bit
  parameter with ``master_weights``; else two moments in the parameter's dtype. Nothing where its state
  already exists (it is in the allocated bytes).
* any other parameter that needs a gradient and that no optimizer has stepped yet (torch's global
  step hook records the parameters of each optimizer's first step): ``torch.optim.AdamW``'s two moments
  in its dtype, assumed.
  It is the common case and the larger of the usual ones (SGD with momentum holds one moment, plain SGD
  none); a smaller state leaves slack that the plan spends from the second step on
  (``opsmath.memory.replan``). A resumed optimizer whose state was loaded before the first call is
  counted twice at the first step, for the same reason harmlessly.

The ``step`` counters (one scalar per parameter) are left out.

``eight_bit_lever``: what the groups with ``state_bits="auto"`` would save as 8-bit state, and the switch
the planner throws when a byte budget needs it (``opsmath.memory.first_plan``).
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from opsmath.kernels.adamw_8bit import QBLOCK

LIVE: "weakref.WeakSet" = weakref.WeakSet()
_STEPPED_OPTIMIZERS: "weakref.WeakSet" = weakref.WeakSet()
STEPPED: set[int] = set()   # ids of the parameters some optimizer has stepped (while they live): state exists


def _record_step(optimizer, args, kwargs) -> None:
    """torch's global post-step hook: an optimizer's first step records its parameters (by id, dropped
    when the parameter is freed: tensors compare elementwise, so no weak set of them)."""
    if optimizer not in _STEPPED_OPTIMIZERS:
        _STEPPED_OPTIMIZERS.add(optimizer)
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            if id(p) not in STEPPED:
                STEPPED.add(id(p))
                weakref.finalize(p, STEPPED.discard, id(p))


register_optimizer_step_post_hook(_record_step)


def _numel(p: torch.Tensor) -> int:
    """Elements of ``p`` on this rank (an FSDP2 ``DTensor`` counts its local shard)."""
    return (p.to_local() if hasattr(p, "to_local") else p).numel()


def layout_bytes(p: torch.Tensor, group: dict, bits=None) -> int:
    """State bytes opsmath's AdamW allocates for ``p`` under ``group``'s settings (``bits``: as if its
    ``state_bits`` were that; "auto" is 32 until the planner decides)."""
    n = _numel(p)
    master = group.get("master_weights", False) and p.dtype != torch.float32   # an fp32 copy, fp32 moments
    if (bits or group.get("state_bits", 32)) == 8:
        moments = 2 * n + 2 * 4 * -(-n // QBLOCK)
    else:
        moments = 2 * n * (4 if master else p.element_size())
    return moments + (4 * n if master else 0)


def _owners() -> dict:
    return {id(p): (opt, g) for opt in list(LIVE) for g in opt.param_groups for p in g["params"]}


def state_to_come(params) -> tuple[int, int]:
    """``(bytes, assumed)``: the optimizer state the first ``step()`` will allocate for ``params``, and
    the part of it assumed (parameters no opsmath optimizer holds: AdamW's two moments)."""
    owner = _owners()
    total = assumed = 0
    for p in params:
        if not (isinstance(p, torch.Tensor) and p.requires_grad):
            continue
        hit = owner.get(id(p))
        if hit is None and id(p) in STEPPED:
            continue
        if hit is None:
            n = 2 * _numel(p) * p.element_size()
            total, assumed = total + n, assumed + n
        elif not dict.get(hit[0].state, p):   # a defaultdict: ``get`` creates nothing
            total += layout_bytes(p, hit[1])
    return total, assumed


def eight_bit_lever(params) -> tuple[int, object]:
    """``(bytes saved, switch)``: what 8-bit moments would save over the state to come of ``params`` held
    by ``state_bits="auto"`` groups of opsmath AdamW optimizers, and a callable that makes those groups 8-bit
    (before any of their state exists: nothing is converted). ``(0, None)`` where there are none."""
    owner, saved, groups = _owners(), 0, {}
    for p in params:
        hit = owner.get(id(p)) if isinstance(p, torch.Tensor) and p.requires_grad else None
        if hit is None or hit[1].get("state_bits") != "auto" or dict.get(hit[0].state, p):
            continue
        saved += layout_bytes(p, hit[1]) - layout_bytes(p, hit[1], bits=8)
        groups[id(hit[1])] = hit[1]

    def switch():
        for g in groups.values():
            g["state_bits"] = 8
    return (saved, switch) if saved > 0 else (0, None)


def in_backward_lever(params) -> tuple[int, object]:
    """``(gradient bytes, switch)``: the gradients of ``params`` held by opsmath AdamW optimizers with
    ``in_backward="auto"``, which stepping inside backward keeps from being alive all at once (one block's
    at a time, under ``opsmath.optimize``), and a callable that turns it on. ``(0, None)`` where none."""
    owner, saved, opts = _owners(), 0, {}
    for p in params:
        hit = owner.get(id(p)) if isinstance(p, torch.Tensor) and p.requires_grad else None
        if hit is None or not getattr(hit[0], "in_backward_auto", False):
            continue
        saved += _numel(p) * p.element_size()
        opts[id(hit[0])] = hit[0]

    def switch():
        for opt in opts.values():
            opt.step_in_backward()
    return (saved, switch) if saved else (0, None)


def steps_in_backward(params) -> bool:
    """Whether an opsmath AdamW with ``in_backward=True`` holds any of ``params``."""
    owner = _owners()
    return any(getattr(hit[0], "_in_backward", None) is not None
               for p in params if (hit := owner.get(id(p))) is not None)
