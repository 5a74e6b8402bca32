"""Lowered pieces of a split graph, compiled lazily at their first call with the real inputs they get.

A graph with regions left to eager (autograd Functions, tensor hooks, checkpoints kept as written) is
split around them (``regions.split_around``); each piece between them, each Function region and each
checkpoint body becomes a ``LazyPiece``. Sizes: a piece compiles for the sizes it meets, one compile
each, up to ``PIECE_SIZES``. A piece between regions (``symbolic=True``) compiles for its first size,
then, at a second size, once more through dynamo with symbolic sizes (``torch.compile(piece,
dynamic=True)`` with the same backend): dynamo guards that compile by itself, so a loader with many
sequence lengths keeps one rewritten, compiled piece instead of running it as traced past the limit.
Numbers: a piece that reads an input as a Python number (``.item()`` of a 0-dim CPU tensor: dynamo's form
for a float attribute that changed between captures, two models of a class whose norms' eps differ) is
compiled with the number in place of the read, once per value it meets (the same limit): compiled on its
own, without dynamo's shape environment, Inductor cannot read it and the piece would run op by op.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from opsmath.capture.lower import _symbolic

PIECE_SIZES = 8   # sizes a piece or Function region is compiled for (as dynamo's recompile limit)
log = logging.getLogger("opsmath")


class LazyPiece(torch.nn.Module):
    """A lowered piece of a split graph, compiled by ``compile_piece(gm, args)`` at its first call with
    the real inputs it receives there (what a dynamo backend gets), then run through the result. The
    compiled piece is specialized to those inputs' sizes. At a call with other sizes (the parent graph
    has dynamic sizes): with ``symbolic``, one compile through dynamo with symbolic sizes serves every
    later size (if it fails, the piece falls back to the per-size compiles); without, the piece compiles
    again for the new sizes, up to ``PIECE_SIZES`` sizes (each compile costs seconds under Inductor), and
    further sizes run the piece as dynamo traced it (eager, unrewritten: what ``torch.compile`` does at
    its recompile limit), and ``errors`` gets a line saying so (once). ``symbolic_first``: the piece was
    cut from a graph dynamo already traced with symbolic sizes (sizes vary): its first call compiles
    with symbolic sizes at once, not once more for its first size."""

    def __init__(self, gm: fx.GraphModule, compile_piece, errors: Optional[list] = None,
                 what: str = "a graph piece between regions left to eager", symbolic: bool = False,
                 symbolic_first: bool = False):
        super().__init__()
        self.gm, self._compile, self._fns, self._errors, self._what = gm, compile_piece, {}, errors, what
        self._symbolic, self._dynamic = symbolic, None
        self._first = symbolic and symbolic_first   # cut from a graph dynamo traced with symbolic sizes
        self._only = None   # the one compile of a piece whose every size is fixed (``fixed_sizes``)
        self._fixed = fixed_sizes(gm)
        self._one_tensor = _returns_one_tensor(gm)   # read before any compile can change the graph
        self._numbers = number_inputs(gm)   # inputs read as Python numbers: their values join the key
        if self._numbers:
            self._symbolic = self._first = self._fixed = False

    def _key(self, args) -> tuple:
        # a number an input passes (a float the piece before computed) is compiled in as a constant
        return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a if isinstance(a, (int, float)) else None
                     for a in args) + tuple(args[i].item() for i in self._numbers)

    def compile_for(self, args, key=None):
        key = self._key(args) if key is None else key
        if key not in self._fns:   # (the backend it compiles through turns saved-tensor hooks off)
            if len(self._fns) >= PIECE_SIZES:
                note = (f"{self._what} met more than {PIECE_SIZES} input sizes or values of the numbers it "
                        "reads: further ones run it as traced (not rewritten, not compiled); padding lengths to "
                        "a few buckets (or passing a number that changes as a tensor) keeps it optimized")
                if self._errors is not None and note not in self._errors:   # said once
                    self._errors.append(note)
                return self.gm.forward
            gm, returned = with_numbers(self.gm, {i: args[i].item() for i in self._numbers}) \
                if self._numbers else (self.gm, {})
            fn = _returning(self._compile(gm, list(args)), returned)
            self._fns[key] = _bare(fn) if self._one_tensor else fn
            if self._fixed:
                self._only = self._fns[key]
        return self._fns[key]

    def forward(self, *args):
        if self._only is not None:   # sizes fixed by the parent's guards: no key to read at every call
            return self._only(*args)
        key = self._key(args)
        if not self._symbolic or (not self._fns and not self._first) or key in self._fns:
            return self.compile_for(args, key)(*args)
        if self._dynamic is None:
            self._dynamic = torch.compile(self.gm, backend=self._compile, dynamic=True)
            try:
                return self._dynamic(*args)
            except Exception as e:  # the symbolic compile failed: sizes are compiled one by one instead
                log.warning("opsmath: %s could not be compiled with symbolic sizes (%s: %s); compiling it per "
                            "size", self._what, type(e).__name__, str(e)[:200])
                self._symbolic = False
                return self.compile_for(args, key)(*args)
        return self._dynamic(*args)


def _reads_number(n: fx.Node) -> bool:
    return n.op in ("call_method", "call_function") and getattr(n.target, "__name__", n.target) == "item"


def number_inputs(gm: fx.GraphModule) -> list[int]:
    """Positions of ``gm``'s inputs it reads as Python numbers: 0-dim CPU tensors read with ``.item()``."""
    out = []
    for i, p in enumerate(gm.graph.find_nodes(op="placeholder")):
        v = example(p)
        if isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu" and \
                any(_reads_number(u) for u in p.users):
            out.append(i)
    return out


def with_numbers(gm: fx.GraphModule, values: dict) -> tuple[fx.GraphModule, dict]:
    """A copy of ``gm`` in which each ``.item()`` read of the input at position ``i`` is ``values[i]``
    (the input stays, unread), and ``{output position: number}`` for the numbers it returned (the next
    piece's input), which the copy no longer returns (a compiled graph returns tensors only)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    placeholders, out = graph.find_nodes(op="placeholder"), graph.output_node()
    reads = {r: values[i] for i in values for r in placeholders[i].users if _reads_number(r)}
    returned = {}
    if isinstance(out.args[0], (tuple, list)):
        returned = {k: reads[a] for k, a in enumerate(out.args[0]) if a in reads}
        out.args = (tuple(a for k, a in enumerate(out.args[0]) if k not in returned),)
    for read, value in reads.items():
        for user in list(read.users):
            user.args = map_arg(user.args, lambda a, r=read, v=value: v if a is r else a)
            user.kwargs = map_arg(user.kwargs, lambda a, r=read, v=value: v if a is r else a)
        graph.erase_node(read)
    return fx.GraphModule(gm, graph), returned


def _returning(fn, returned: dict):
    """``fn`` with the numbers ``returned`` ({output position: number}) put back into its outputs."""
    if not returned:
        return fn

    def call(*args):
        out = list(fn(*args))
        for k in sorted(returned):
            out.insert(k, returned[k])
        return tuple(out)
    return call


def example(n: fx.Node):
    """Node ``n``'s example value as dynamo (``example_value``) or make_fx (``val``) recorded it."""
    return n.meta.get("example_value", n.meta.get("val"))


def symbolic_sizes(gm: fx.GraphModule) -> bool:
    """Whether dynamo traced ``gm`` with symbolic sizes (a size input, or an input tensor's size that is one):
    its pieces compile once with symbolic sizes at their first call (``symbolic_first``)."""
    return any(_symbolic(example(p)) for p in gm.graph.find_nodes(op="placeholder"))


def fixed_sizes(gm: fx.GraphModule) -> bool:
    """Whether every value of ``gm`` has sizes dynamo traced as constants (no symbolic size, backed or data-
    dependent): a piece of such a graph meets the one size its parent's guards admit at every call."""
    for n in gm.graph.nodes:
        v = example(n)
        if (n.op == "placeholder" and (v is None or isinstance(v, float))) or \
                any(_symbolic(x) or isinstance(x, (torch.SymFloat, torch.SymBool))
                    for x in (v if isinstance(v, (list, tuple)) else [v])):
            return False   # (an input traced without an example value: unknown; a number: its value is keyed)
    return True


def _returns_one_tensor(gm: fx.GraphModule) -> bool:
    """Whether the piece ``gm`` returns one tensor bare (``split_module``'s form for a single output)."""
    out = gm.graph.output_node().args[0]
    return isinstance(out, fx.Node) and isinstance(example(out), torch.Tensor)


def _bare(fn):
    """``fn`` returning a one-element list's element: Inductor's ``compile_fx`` makes a graph that returns
    one value return it in a tuple, in place, so after a failed compile (the fallback ladder's second
    rung) the piece and its op-by-op run return a list the next piece would read as its input."""
    def call(*args):
        got = fn(*args)
        return got[0] if isinstance(got, (list, tuple)) and len(got) == 1 else got
    return call
