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
pieces run in the graph's order. A graph with fewer than two blocks is not split. The cost: Inductor
fuses nothing across a block boundary (a residual add and the next norm), and each block is compiled
on its own.
"""
from __future__ import annotations

import re
from typing import Optional

import torch.fx as fx

from opsmath.capture.regions import split_by
from opsmath.optim.footprint import steps_in_backward
from opsmath.rewrite.match import module_paths


def block_of(node: fx.Node) -> Optional[str]:
    """The outermost ``nn.ModuleList`` item whose forward produced ``node`` (``"model.layers.3"``), or
    None outside any."""
    for path in module_paths(node):
        m = re.match(r"^(.*?\.\d+)(?:\.|$)", path)
        if m:
            return m.group(1)
    return None


def wanted(model) -> bool:
    """Whether ``model``'s parameters are stepped inside backward (``opsmath.optim.footprint``)."""
    return steps_in_backward(model.parameters())


def split_blocks(gm: fx.GraphModule) -> Optional[tuple[fx.GraphModule, list[str]]]:
    """``(parent, names of its pieces that compute)``: ``gm`` split at its blocks, in order; None where it
    holds fewer than two."""
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
    return split_by(gm, ids, set(), set(ids.values()))
