"""Constant subgraphs evaluated to real tensors: tensor factories, ``get_attr`` constants and module buffers,
which is how ``masked_fill(tril[:T, :T] == 0, -inf)`` and HF's arange-built additive masks are read as causal.

A value is only as constant as the tensors it reads: a factory's tensor written in place by a node the
evaluation does not run (``kpm = zeros(...); kpm[1, 7:] = True`` writes through a view of it) has another
value at run time, so anything reading a tensor that an outside node writes, directly or through a view,
is not a constant (``_written_elsewhere``).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten




_FILLS = {aten.masked_fill_.Scalar, aten.fill_.Scalar}


def _private_fill(n: fx.Node) -> bool:
    """An in-place fill whose target nothing else reads or writes: ``zeros_like(m).masked_fill_(m, -inf)``,
    how ``nn.MultiheadAttention`` turns a boolean mask into a bias. Its value is then that of the
    out-of-place op, and no mutation outside the evaluated nodes can change it."""
    if n.target not in _FILLS or not isinstance(n.args[0], fx.Node) or len(n.args[0].users) != 1:
        return False
    return not any(isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable for u in n.users)


def constant_value(gm: fx.GraphModule, node, constants: dict[str, torch.Tensor], limit: int = 200):
    """Evaluate ``node`` to a real tensor when it depends only on tensor factories, ``get_attr``
    constants and module buffers (``constants``, by placeholder name). Returns None otherwise.

    Factories with device arguments are evaluated on CPU: only the value is wanted. The one kind of
    in-place op evaluated is a fill of a tensor nothing else uses (``_private_fill``).
    """
    if not isinstance(node, fx.Node):
        return node
    order, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.name not in constants:
            return None
        if n.op not in ("placeholder", "get_attr", "call_function"):
            return None
        if n.op == "call_function" and (not isinstance(n.target, torch._ops.OpOverload)
                                        or n.target._schema.is_mutable and n.target is not aten.detach_.default
                                        and not _private_fill(n)):
            return None
        if len(seen) > limit:
            return None
        order.append(n)
        stack.extend(n.all_input_nodes)
    inside = set(order)
    if any(_written_elsewhere(n, inside) for n in order):
        return None
    env = {}
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    try:
        for n in sorted(order, key=pos.__getitem__):
            if n.op == "placeholder":
                env[n] = constants[n.name].detach().cpu()
            elif n.op == "get_attr":
                env[n] = getattr(gm, n.target).detach().cpu() if isinstance(getattr(gm, n.target), torch.Tensor) \
                    else getattr(gm, n.target)
            else:
                args = fx.node.map_arg(n.args, env.__getitem__)
                kwargs = dict(fx.node.map_arg(n.kwargs, env.__getitem__))
                if "device" in kwargs:
                    kwargs["device"] = "cpu"
                if n.target is aten.detach_.default:
                    env[n] = args[0].detach()
                    continue
                if n.target is aten.to.device:
                    args = (args[0], "cpu", *args[2:])
                env[n] = n.target(*args, **kwargs)
    except Exception:  # anything unexpected: not a constant we understand
        return None
    out = env[node]
    return out if isinstance(out, torch.Tensor) else None


# ops whose results alias an input their schema does not mark (followed as views), and ``set_``, which makes
# another tensor share the storage of the one it reads (counted as a write)
_UNMARKED_VIEWS = {aten.unsafe_split, aten.unsafe_split_with_sizes, aten.unsafe_chunk, aten._unsafe_view}
_REBINDS = {aten.set_}


def _written_elsewhere(n: fx.Node, inside: set) -> bool:
    """Whether a node outside ``inside`` may write ``n``'s tensor: an in-place op on it or on a view of it
    (views followed through every op whose result aliases its input, and ``getitem`` of a ``split``'s
    list). A reader of another kind (a Python function, a higher-order op) counts as a writer."""
    stack, seen = [n], set()
    while stack:
        x = stack.pop()
        for u in x.users:
            if u in seen:
                continue
            seen.add(u)
            if u.op == "output":
                continue
            if u.op == "call_function" and u.target is operator.getitem:
                stack.append(u)
                continue
            if not isinstance(u.target, torch._ops.OpOverload) or u.target.overloadpacket in _REBINDS:
                return True
            if u.target.overloadpacket in _UNMARKED_VIEWS:
                stack.append(u)
                continue
            schema = u.target._schema
            aliased = [a.alias_info for a in _holding(u, schema, x) if a.alias_info is not None]
            if schema.is_mutable and u not in inside and u.target is not aten.detach_.default \
                    and any(a.is_write for a in aliased):
                return True
            if aliased and any(r.alias_info is not None for r in schema.returns):   # a view of it, or itself
                stack.append(u)
    return False


def _holding(u: fx.Node, schema, x: fx.Node) -> list:
    """The schema arguments of op ``u`` that take ``x`` (or a list holding it)."""
    out = []
    for i, arg in enumerate(schema.arguments):
        value = u.args[i] if i < len(u.args) else u.kwargs.get(arg.name)
        if value is x or isinstance(value, (list, tuple)) and any(v is x for v in value):
            out.append(arg)
    return out
