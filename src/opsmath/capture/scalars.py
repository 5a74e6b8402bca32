"""Capture: Python scalars that tracing turned into CPU tensor constants, moved onto the graph's device.

``y[..., 0] = 0`` (T5's ``_shift_right``, many masking helpers) traces, pre-dispatch, into::

    c = self._tensor_constant0            # torch.tensor(0): a 0-dim CPU tensor
    fill_(select(y, 1, 0), lift_fresh_copy(c))

Under ``torch.compile`` the constant stays a ``get_attr`` and Inductor inlines it as a number. A
rewritten graph goes to Inductor through AOTAutograd once more, which lifts the constant to a graph
*input*: the compiled forward then copies a CPU tensor to the GPU every step, a pageable host-to-device
copy with a ``cudaStreamSynchronize`` (T5, H200: one sync per step, 0.97x compile's step, host-bound).

``device_scalars`` replaces each ``lift_fresh_copy`` of such a constant by
``aten.scalar_tensor(value, dtype, device)`` on the device its readers compute on, where every reader's
result has the constant's dtype (``fill_``, ``index_put_``: tracing made the constant in the written
tensor's dtype). A 0-dim tensor takes part in type promotion and broadcasting the same way on any device;
but where a reader computes in another dtype, CUDA's elementwise kernels read a 0-dim CPU operand as a
scalar in their compute type and cast a 0-dim CUDA operand to the result's dtype first (``x_bf16 *
tensor(1 + 2**-20)`` rounds differently), so such a reader keeps the CPU constant, as does one that would
change device (the constant the only tensor it reads, or readers on several devices).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

aten = torch.ops.aten


def device_scalars(gm: fx.GraphModule, fake_mode) -> int:
    """Replace the 0-dim CPU constants' copies in ``gm`` (see module doc); how many were replaced.
    ``fake_mode``: the mode of the graph's ``meta["val"]``, for the new nodes' own."""
    moved = 0
    for const in list(gm.graph.find_nodes(op="get_attr")):
        value = getattr(gm, const.target, None)
        if not _cpu_scalar(value):
            continue
        number = value.item()
        for lift in [u for u in const.users if u.target is aten.lift_fresh_copy.default]:
            device = _readers_device(lift, value.dtype)
            if device is None:
                continue
            with gm.graph.inserting_before(lift):
                new = gm.graph.call_function(aten.scalar_tensor.default, (number,),
                                             dict(dtype=value.dtype, device=device))
            new.meta.update({k: v for k, v in lift.meta.items() if k != "val"})
            with fake_mode:
                new.meta["val"] = aten.scalar_tensor.default(number, dtype=value.dtype, device=device)
            lift.replace_all_uses_with(new)
            gm.graph.erase_node(lift)
            moved += 1
        if not const.users:
            gm.graph.erase_node(const)
            delattr(gm, const.target)
    if moved:
        gm.recompile()
    return moved


def _cpu_scalar(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu" \
        and not value.requires_grad and not isinstance(value, torch._subclasses.FakeTensor)


def _readers_device(lift: fx.Node, dtype: torch.dtype) -> Optional[torch.device]:
    """The one non-CPU device every reader of ``lift`` computes on (its other tensor inputs and its
    results), or None where a reader reads no other tensor, any of them is elsewhere, or a reader's
    result is not of ``dtype`` (module doc)."""
    devices = set()
    for user in lift.users:
        out = user.meta.get("val")
        outs = out if isinstance(out, (tuple, list)) else [out]
        if user.op != "call_function" or any(not isinstance(o, torch.Tensor) or o.dtype != dtype for o in outs):
            return None
        others = [a for a in user.all_input_nodes if a is not lift]
        seen = [_device(a.meta.get("val")) for a in others] + [_device(user.meta.get("val"))]
        if not others or any(d is None for d in seen):
            return None
        devices.update(seen)
    if len(devices) != 1:
        return None
    (device,) = devices
    return device if device.type != "cpu" else None


def _device(val) -> Optional[torch.device]:
    """The device of a node's value: a tensor's, or the one device of a tuple's tensors; None otherwise."""
    if isinstance(val, torch.Tensor):
        return val.device
    if isinstance(val, (tuple, list)):
        found = {v.device for v in val if isinstance(v, torch.Tensor)}
        return found.pop() if len(found) == 1 and all(isinstance(v, torch.Tensor) for v in val) else None
    return None
