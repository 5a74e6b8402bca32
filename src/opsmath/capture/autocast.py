"""``torch.autocast`` entered inside the captured code, as Accelerate (HF ``Trainer(bf16=True)``, Lightning's
``"bf16-mixed"`` through Fabric) does by wrapping ``model.forward``.

Dynamo records such a region as ``_enter_autocast`` / ``_exit_autocast`` nodes, and the pre-dispatch ATen
graph keeps them: its ops carry autocast's output dtypes but not its casts, which happen when the graph
runs. The rewrite rules read a graph the way it is when autocast is *around* the call (the usual
``with torch.autocast(...): loss = model(x)``): a fused op sees its inputs uncast, so a rule makes autocast's
casts explicit. Inside a region that reasoning does not hold (measured: the attention backward got fp32 q/k
beside a bf16 v and failed to compile; dropout-add-norm refused an fp32 + bf16 pair).

- A region that holds the whole computation (nothing but bookkeeping before it, and after it nothing but
  what autocast leaves alone: Accelerate's ``.float()`` of the outputs, ``getitem``) is *hoisted*: its two
  nodes are removed and the graph is captured, rewritten, compiled and run under the same autocast, around
  it. Same values: autocast acts on ops in its scope, and every op was in it.
- Any other region enabling autocast: ``autocast_inside`` says so and the graph is left unrewritten, with a
  note in the report (never a rewrite whose dtypes the rules could not see).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

_ENTER, _EXIT = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast
# nodes that read no dtype autocast would change: the bookkeeping and output conversions around a region
_NEUTRAL_FUNCTIONS = {operator.getitem, torch._C._set_grad_enabled}
_NEUTRAL_METHODS = {"float", "to", "double", "half", "bfloat16", "type", "contiguous", "size", "dim", "detach"}


@dataclass(frozen=True)
class Region:
    """An autocast region's arguments: ``torch.autocast(device_type, dtype, enabled, cache_enabled)``."""
    device_type: str
    dtype: Optional[torch.dtype]
    enabled: bool
    cache_enabled: Optional[bool]

    def context(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled,
                              cache_enabled=self.cache_enabled)

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` run under this autocast: the graph's forward, as its region ran it."""
        def under_autocast(*args, **kwargs):
            with self.context():
                return fn(*args, **kwargs)
        return under_autocast


def _neutral(n: fx.Node) -> bool:
    if n.op in ("placeholder", "output", "get_attr"):
        return True
    if n.op == "call_function":
        return n.target in _NEUTRAL_FUNCTIONS
    return n.op == "call_method" and n.target in _NEUTRAL_METHODS


def _enabling(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is _ENTER and len(n.args) >= 3 and n.args[2] is True


def hoist_whole_region(gm: fx.GraphModule) -> Optional[Region]:
    """Remove an enabled autocast region that spans all of ``gm``'s computation and return its arguments
    (the caller runs the graph under ``Region.context()``); None, ``gm`` unchanged, when there is none."""
    nodes = list(gm.graph.nodes)
    enter = next((n for n in nodes if n.op == "call_function" and n.target is _ENTER), None)
    if enter is None or not _enabling(enter) or not all(_neutral(n) for n in nodes[:nodes.index(enter)]):
        return None
    exits = [u for u in enter.users if u.op == "call_function" and u.target is _EXIT]
    if len(exits) != 1 or len(enter.users) != 1:
        return None
    (exit_,) = exits
    if not all(_neutral(n) for n in nodes[nodes.index(exit_) + 1:]):
        return None
    device_type, dtype, enabled, cache = (list(enter.args) + [None])[:4]
    gm.graph.erase_node(exit_)
    gm.graph.erase_node(enter)
    gm.recompile()
    return Region(device_type, dtype, enabled, cache)


def autocast_inside(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` enables autocast for part of itself (a region left after ``hoist_whole_region``)."""
    return any(_enabling(n) for n in gm.graph.nodes)
