"""A captured graph split block by block, for an optimizer that steps inside backward.

``opsmath.optim.AdamW(..., in_backward=True)`` updates each parameter when its gradient is final and
frees the gradient, so no full set of gradients is alive. Under Inductor a graph is one AOTAutograd
function whose backward returns every gradient of the graph at once, at its end: the hooks fire only
then, and the step peaks as high as without. Split at the model's repeated blocks (the items of an
``nn.ModuleList``: ``layers.3``, ``h.11``, ``encoder.layer.5``), each block is a graph of its own,
captured, rewritten, planned and compiled as any piece (``capture/pieces.py``): its backward returns
its block's gradients, which are applied and freed before the next block's backward runs.

Nodes outside any block (embeddings, the final norm, the head and the loss) join the block before them
(before the first block: the first); a block's partition never goes back (a running maximum), so the
pieces run in the graph's order. A graph with fewer than two blocks is not split. Under a byte
``memory_budget`` each piece is planned at its first call, when the pieces before it hold what they
keep, for its share of what is left (``memory.budget.share_budget``): its weight, the bytes of the
tensors its nodes produce, against the later pieces' (``BLOCK_SHARE``), after the tensors it and the
later pieces hand on (which stay alive outside any piece's plan), so that the first blocks do not keep
what the last ones need. The cost: Inductor fuses nothing across a block boundary (a residual add
and the next norm), and each block is compiled on its own.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.fx as fx

from opsmath.capture.regions import split_by
from opsmath.meta_keys import BLOCK_SHARE
from opsmath.optim.footprint import steps_in_backward
from opsmath.rewrite.match import module_paths


PIECE = "opsmath_block_piece"   # GraphModule.meta key of a block's piece: never split again


def block_of(node: fx.Node) -> Optional[str]:
    """The outermost ``nn.ModuleList`` item whose forward produced ``node`` (``"model.layers.3"``), or
    None outside any. Experts (an item of a list named ``*expert*``) are no blocks: a loop over them is
    rewritten whole, and a graph of one MoE module (``patterns/experts/regional.py``) is not split."""
    for path in module_paths(node):
        m = re.match(r"^(.*?)\.\d+(?:\.|$)", path)
        if m:
            return None if "expert" in m.group(1).rsplit(".", 1)[-1].lower() else m.group(0).rstrip(".")
    return None


def split_blocks(gm: fx.GraphModule) -> Optional[tuple[fx.GraphModule, list[str]]]:
    """``(parent, names of its pieces that compute)``: ``gm`` split at its blocks, in order; None where it
    holds fewer than two, or is itself such a piece (whose copied index values, ``recompute_in_pieces``,
    still name the block that computed them first)."""
    if gm.meta.get(PIECE):
        return None
    order, ids, part = {}, {}, 0
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        block = block_of(n)
        if block is not None and block not in order:
            order[block] = len(order)
        part = max(part, order.get(block, 0))
        ids[n] = part
    if len(order) < 2:
        return None
    # piece -> bytes of the tensors its nodes produce (its share of a byte budget), and of those a later
    # piece reads (the residual stream handed on: alive beyond the piece, outside what its plan keeps)
    weight, carried = {}, {}
    for n, part in ids.items():
        val = n.meta.get("example_value", n.meta.get("val"))
        if isinstance(val, torch.Tensor) and isinstance(val.numel(), int):   # (symbolic sizes: not planned)
            size = val.numel() * val.element_size()
            weight[part] = weight.get(part, 0) + size
            if any(ids.get(u, -1) > part for u in n.users):
                carried[part] = carried.get(part, 0) + size
    parent, names = split_by(gm, ids, set(), set(ids.values()))
    for name in names:
        part = int(name.rsplit("_", 1)[1])
        getattr(parent, name).meta.update({PIECE: True, BLOCK_SHARE: (
            weight.get(part, 0), sum(w for p, w in weight.items() if p > part),
            sum(c for p, c in carried.items() if p >= part))})
    return parent, names


def split_for_optimizer(model, gm: fx.GraphModule, regions) -> tuple[Optional[tuple], Optional[str]]:
    """``(split_blocks(gm), None)`` when ``model``'s parameters are stepped inside backward
    (``opsmath.optim.footprint``) and ``gm`` splits; else ``(None, why)`` for the report: why the graph
    stays whole, so that all of its gradients exist at once at its backward's end and the optimizer saves
    nothing on it. ``(None, None)`` when the optimizer does not step inside backward or ``gm`` is a
    block's piece already. Not split: a graph holding autograd Functions or checkpoints (it is split
    around them instead)."""
    if not steps_in_backward(model.parameters()) or gm.meta.get(PIECE):
        return None, None
    if regions:
        why = "it holds autograd Functions or checkpoints, which it is split around instead"
    else:
        parts = split_blocks(gm)
        if parts is not None:
            return parts, None
        why = "it holds fewer than two blocks (items of an nn.ModuleList)"
    return None, (f"the optimizer steps inside backward, but a graph stays whole: {why}; its gradients are all "
                  "alive at the end of its backward")
