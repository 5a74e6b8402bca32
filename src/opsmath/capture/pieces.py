"""Lowered pieces of a split graph, compiled lazily at their first call with the real inputs they get.

A graph with regions left to eager (autograd Functions, tensor hooks, checkpoints kept as written) is
split around them (``regions.split_around``); each piece between them, each Function region and each
checkpoint body becomes a ``LazyPiece``. Sizes: a piece compiles for the sizes it meets, one compile
each, up to ``PIECE_SIZES``. A piece between regions (``symbolic=True``) compiles for its first size,
then, at a second size, once more through dynamo with symbolic sizes (``torch.compile(piece,
dynamic=True)`` with the same backend): dynamo guards that compile by itself, so a loader with many
sequence lengths keeps one rewritten, compiled piece instead of running it as traced past the limit.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.fx as fx

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

    @staticmethod
    def _key(args) -> tuple:
        return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a if isinstance(a, int) else None
                     for a in args)

    def compile_for(self, args, key=None):
        key = self._key(args) if key is None else key
        if key not in self._fns:   # (the backend it compiles through turns saved-tensor hooks off)
            if len(self._fns) >= PIECE_SIZES:
                note = (f"{self._what} met more than {PIECE_SIZES} input sizes: "
                        "further sizes run it as traced (not rewritten, not compiled); padding lengths to a few "
                        "buckets keeps it optimized")
                if self._errors is not None and note not in self._errors:   # said once
                    self._errors.append(note)
                return self.gm.forward
            fn = self._compile(self.gm, list(args))
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
        if (v is None and n.op == "placeholder") or any(_symbolic(x) or isinstance(x, (torch.SymFloat, torch.SymBool))
                                                        for x in (v if isinstance(v, (list, tuple)) else [v])):
            return False   # (an input traced without an example value: unknown, so not fixed)
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
