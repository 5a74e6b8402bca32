"""A loss head compiled as a graph of its own, where the graph also returns the tensor the loss reads.

Hugging Face's task models return ``(loss, logits)``: the loss is computed in ``forward`` from the
logits it also returns. Captured as one graph, AOTAutograd's backward takes one gradient input per
differentiable output, the logits' among them. A caller that reads only ``.loss`` sends none, and
autograd materializes it as zeros: a ``[B, T, V]`` tensor (0.38 GiB for GPT-2 at B4 T1024 in bf16)
allocated at the start of backward, at the step's peak. Where ``torch.compile`` breaks its graph at HF's
``loss_function`` (GPT-2 under torch 2.11), its body graph gets one real gradient for the logits instead.

``loss_head`` finds that structure in dynamo's graph: an output tensor ``x`` that needs a gradient and
that nodes of the graph read, whose descendants (the head) read no parameter, run in the graph's
entry grad and autocast state, write in place only what they make themselves (nor does anything
computed after them write in place), and compute a scalar output that needs a gradient (the loss).
The graph is then split in two pieces, everything but the head, and the head with ``x`` as an input;
the head's backward hands the body's backward ``x``'s gradient (autograd adds whatever the caller
sends through the returned ``x``).
Values: exactly the single graph's (the same ops on the same inputs); cost: the head and the body are
fused apart, as under ``torch.compile``'s graph break.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from opsmath.capture.autocast import _ENTER, _EXIT
from opsmath.capture.pieces import example
from opsmath.capture.regions import _INPLACE_OPERATORS, _name, split_by

MIN_BYTES = 16 << 20     # outputs smaller than this cost less as a zero gradient than a graph boundary
MAX_HEAD_NODES = 256     # a loss head is a few dozen nodes (upcast, shift, cross-entropy, mean)
log = logging.getLogger("opsmath")


def _bytes(v: torch.Tensor) -> int:
    """``v``'s bytes at the sizes dynamo traced with (a symbolic size's hint; 0 where one has none),
    read without adding a guard."""
    n = v.element_size()
    for s in v.shape:
        hint = s.node.hint if isinstance(s, torch.SymInt) else s
        if hint is None:
            return 0
        n *= int(hint)
    return n


def _descendants(x: fx.Node, output: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [u for u in x.users if u is not output]
    while stack and len(seen) <= MAX_HEAD_NODES:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(u for u in n.users if u is not output)
    return seen


def _reads_parameter(head: set[fx.Node], params: set[fx.Node]) -> bool:
    return any(a in params or a.op == "get_attr" for n in head for a in n.all_input_nodes)


def _moved_safely(gm: fx.GraphModule, head: set[fx.Node]) -> bool:
    """Whether moving ``head`` to the graph's end (and running it as a graph of its own after the rest)
    keeps every value: no node of the rest after the head's first node writes a tensor in place (the
    head would read it after the write: a buffer updated after the loss read it), no head node writes a
    tensor the head did not make, and every head node runs under the grad mode and autocast state the
    graph ends in (the entry state: dynamo restores it), which the head's own graph runs under. A
    ``torch.enable_grad()`` block around the loss in a model called under ``no_grad`` is refused: moved
    past the block's end, the loss would come back without a gradient."""
    depth, grad, end_grad, started = 0, None, torch.is_grad_enabled(), False
    for n in gm.graph.nodes:
        if n.target is _ENTER:
            depth += 1
        elif n.target is _EXIT:
            depth -= 1
        elif n.target is torch._C._set_grad_enabled:
            grad = bool(n.args[0])
        elif n in head:
            started = True
            if depth or (grad is not None and grad != end_grad):
                return False
            if _mutates(n) and not (n.args and n.args[0] in head):
                return False
        elif started and _mutates(n):
            return False
    return True


def _mutates(n: fx.Node) -> bool:
    """Whether dynamo's node ``n`` writes a tensor in place (an ``op_`` method or function, a Python
    in-place operator, ``out=``, ``inplace=True``, a mutable ATen schema)."""
    if n.op not in ("call_function", "call_method"):
        return False
    if "out" in n.kwargs or n.kwargs.get("inplace") is True:
        return True
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target._schema.is_mutable
    name = _name(n)
    if getattr(n.target, "__module__", None) in ("_operator", "operator"):
        return name in _INPLACE_OPERATORS
    if name.startswith("__") and name.endswith("__"):
        return name[2:-2] in _INPLACE_OPERATORS
    return name.endswith("_") and not name.startswith("_")


def _loss_out(head: set[fx.Node], outputs: list[fx.Node]) -> bool:
    for n in outputs:
        v = example(n)
        if n in head and isinstance(v, torch.Tensor) and v.dim() == 0 and v.requires_grad:
            return True
    return False


def loss_head(gm: fx.GraphModule, example_inputs: list) -> Optional[tuple[fx.Node, set[fx.Node]]]:
    """The returned tensor and the loss head computed from it in dynamo's graph ``gm`` (module
    docstring), or None where the graph has no such structure."""
    output = gm.graph.output_node()
    outputs = [a for a in pytree.tree_leaves(output.args) if isinstance(a, fx.Node)]
    placeholders = gm.graph.find_nodes(op="placeholder")
    params = {p for p, t in zip(placeholders, example_inputs) if isinstance(t, torch.nn.Parameter)}
    for x in dict.fromkeys(outputs):
        v = example(x)
        if not isinstance(v, torch.Tensor) or not v.requires_grad or x.op == "placeholder":
            continue
        if _bytes(v) < MIN_BYTES:
            continue
        head = _descendants(x, output)
        if not head or len(head) > MAX_HEAD_NODES or _reads_parameter(head, params) \
                or not _loss_out(head, outputs) or not _moved_safely(gm, head):
            continue
        return x, head
    return None


def head_ids(gm: fx.GraphModule, head: set[fx.Node]) -> dict[fx.Node, int]:
    """Piece of every computing node: 1 for the head, 0 for the rest. The head's nodes are moved to the
    graph's end first, in their order: the rest never reads the head (which holds every descendant of
    the split tensor), and ``split_module`` needs the pieces in order where the graph enters an autocast
    region or switches grad mode (HF's rotary embedding does)."""
    output = gm.graph.output_node()
    for n in [n for n in gm.graph.nodes if n in head]:
        output.prepend(n)
    gm.recompile()
    return {n: int(n in head) for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")}


def split_loss_head(gm: fx.GraphModule, found: tuple[fx.Node, set[fx.Node]]
                    ) -> Optional[tuple[fx.GraphModule, list[str], str]]:
    """``gm`` split into its body and the loss head ``found`` (``loss_head``: the tensor it reads, its
    nodes): the parent, its two piece names and the report's note; None where the split fails (the
    graph stays whole)."""
    x, head = found
    try:   # (moving the head to the graph's end and copying index values into it keep gm's values)
        parent, pieces = split_by(gm, head_ids(gm, head), set(), {0, 1})
    except Exception as e:   # the graph stays whole, as before
        log.debug("opsmath: loss head not split off: %s", e)
        return None
    if len(pieces) != 2:
        return None
    return parent, pieces, (f"the loss computed from `{x.name}` is a graph of its own: the `{x.name}` the model "
                            "returns gets no zero gradient in backward (as torch.compile's graph break at the loss)")


def returned_gradients(gm: fx.GraphModule, split: Optional[fx.Node] = None) -> list[torch.Tensor]:
    """The example values of the tensors ``gm`` (dynamo's graph of a training step) returns beside a
    scalar loss that need a gradient (the ``split`` tensor, whose gradient the loss head's graph gives,
    aside); empty where the graph returns no loss. AOTAutograd's backward takes a gradient for each,
    allocated when that backward starts: the caller's, or zeros autograd makes wherever the caller does
    not backpropagate through it."""
    output = gm.graph.output_node()
    outputs = list(dict.fromkeys(a for a in pytree.tree_leaves(output.args) if isinstance(a, fx.Node)))
    vals = [example(n) for n in outputs if n is not split and n.op != "placeholder"]
    grads = [v for v in vals if isinstance(v, torch.Tensor) and v.requires_grad]
    if not any(v.dim() == 0 for v in grads):   # no loss in the graph: the caller's own
        return []
    return [v for v in grads if v.dim() > 0]


def returned_gradient_bytes(gm: fx.GraphModule) -> int:
    """The bytes of ``returned_gradients(gm)``: what a memory plan holds at the end of the forward for
    them (the backward's first ops free them)."""
    return sum(_bytes(v) for v in returned_gradients(gm))


def zero_gradient_note(gm: fx.GraphModule, split: Optional[fx.Node] = None) -> Optional[str]:
    """The report's note where ``gm`` returns ``MIN_BYTES`` or more of ``returned_gradients`` (HF's K/V
    cache, returned in training under the default ``use_cache=True``: two per layer). ``torch.compile``
    makes the same zeros."""
    extra = returned_gradients(gm, split)
    total = sum(_bytes(v) for v in extra)
    if not extra or total < MIN_BYTES:
        return None
    return (f"tensors returned beside the loss that need a gradient: {len(extra)}, {total / 2**20:.0f} MiB; backward "
            "allocates a zero gradient for each the caller does not backpropagate through (HF models return "
            "their K/V cache in training unless `model.config.use_cache = False`)")
