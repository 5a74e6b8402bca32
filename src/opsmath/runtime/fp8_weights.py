"""FP8 weight copies made once per optimizer step, not in every forward.

A tensorwise FP8 linear (``kernels.fp8_linear``) casts its weight to e4m3 in every forward (and, under
Inductor, again in backward); under gradient accumulation each micro-step repeats the casts of unchanged
weights. ``optimize(fp8="cached")`` instead hands each FP8 linear whose weight requires grad two more graph
inputs, the weight's e4m3 copy and its scale (``src/opsmath/patterns/fp8_linear.py`` adds them), kept here per
parameter. Before a graph runs, the
copies of its weights that may be stale are made again, all in one fused cast (``kernels.fp8_cast``;
PyTorch ops on the CPU), bit for bit what the in-graph cast computes.

A copy is reused only when nothing can have changed its weight since the cast:

- the weight's storage and version counter are those of the cast (an optimizer's in-place step,
  ``load_state_dict``, any in-place write through the parameter or a ``.detach()`` of it bumps the
  version), and
- a backward has since accumulated into the weight's gradient (a post-accumulate-grad hook records it),
  and the gradient is still the tensor it left, at the version it left.

That is micro-steps 2..k of an accumulation window. ``zero_grad`` (to None or to zeros) breaks the chain,
so the first forward after each optimizer step casts anew, even after optimizers that write weights
behind autograd's version counter (fused CUDA extensions, writes through ``.data``). A forward without a
backward since (evaluation, two forwards before one backward) casts again. The case left: a weight
written behind the version counter between two micro-steps with its gradient untouched; ``skip=
["fp8_weight_cache"]`` (or ``fp8=True``) casts in every forward instead. Cost: one e4m3 byte per weight
element, resident (HF LLaMA 1.1B: 0.76 GiB), for 2% of step time (BENCHMARKS.md): hence opt-in.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.fx as fx

from opsmath.meta_keys import FP8_WEIGHT as META

from opsmath.kernels.fp8_cast import CastTables, cast_weights_reference, cast_weights_triton
from opsmath.kernels.fp8_linear import E4M3

TABLES = 64                  # launch tables kept (``WeightCasts._tables_for``)


class _Copy:
    """One parameter's e4m3 copy ``q``, its scale ``s``, and what was true of the parameter at the cast."""

    def __init__(self, w: torch.Tensor, drop):
        self.param = weakref.ref(w, drop)
        self.q = torch.empty(w.shape, dtype=E4M3, device=w.device)
        self.s = torch.ones((), dtype=torch.float32, device=w.device)
        self.stamp = None           # (data_ptr, version) at the cast
        self.grad = None            # (weakref to the gradient, its version) after a backward since
        if w.requires_grad and w.is_leaf:
            me = weakref.ref(self)

            def hook(p: torch.Tensor) -> None:
                if (c := me()) is not None:
                    c.backward_done(p)
            w.register_post_accumulate_grad_hook(hook)

    def backward_done(self, p: torch.Tensor) -> None:
        if self.stamp == (p.data_ptr(), p._version) and p.grad is not None:
            self.grad = (weakref.ref(p.grad), p.grad._version)

    def left_by_backward(self, g: Optional[torch.Tensor]) -> bool:
        """Whether ``g`` is the gradient a backward since the cast left, at the version it left."""
        return self.grad is not None and g is not None and self.grad[0]() is g and g._version == self.grad[1]

    def fresh(self, w: torch.Tensor) -> bool:
        return self.stamp == (w.data_ptr(), w._version) and self.left_by_backward(w.grad)

    def cast_done(self, w: torch.Tensor) -> None:
        self.stamp, self.grad = (w.data_ptr(), w._version), None


class WeightCasts:
    """The FP8 copies of one optimized model's weights, keyed by parameter."""

    def __init__(self):
        self._copies: dict[int, _Copy] = {}
        self._tables: dict[tuple, CastTables] = {}
        self.casts = 0              # weights cast (a count for tests and the report)
        self.reused = 0             # weights whose copy served a forward without a cast

    def grad_replaced(self, p: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> None:
        """``p.grad`` was ``old`` and is now ``new``, a copy of it (``cudagraphs.StepGuard`` moves gradients
        out of the replay pool): a record of ``old`` as a backward left it becomes one of ``new``."""
        c = self._copies.get(id(p))
        if c is not None and c.param() is p and c.left_by_backward(old):
            c.grad = (weakref.ref(new), new._version)

    def nbytes(self) -> int:
        """Bytes the copies hold (resident between steps)."""
        return sum(c.q.numel() + 4 for c in self._copies.values())

    def _copy(self, w: torch.Tensor) -> _Copy:
        """``w``'s copy; a new one where ``w`` has none, or ``w.data`` was replaced by a tensor of another
        shape or device (``module.to``)."""
        c = self._copies.get(id(w))
        if c is None or c.param() is not w or c.q.shape != w.shape or c.q.device != w.device:
            key = id(w)
            c = self._copies[key] = _Copy(w, lambda _: self._forget(key))
        return c

    def _forget(self, key: int) -> None:
        self._copies.pop(key, None)

    def inputs_for(self, weights: list[torch.Tensor], cast: bool = True) -> list[torch.Tensor]:
        """``[q0, s0, q1, s1, ...]`` for ``weights``, each copy made again first unless fresh; ``cast=False``:
        the buffers only, values unset (what compiling a graph needs; its first call casts)."""
        copies = [self._copy(w) for w in weights]
        if not cast:
            return [t for c in copies for t in (c.q, c.s)]
        stale = [(w, c) for w, c in zip(weights, copies) if not c.fresh(w)]
        self.reused += len(weights) - len(stale)
        by_kind: dict[tuple, list] = {}
        for w, c in stale:
            by_kind.setdefault((w.device, w.dtype), []).append((w, c))
        for (device, _), group in by_kind.items():
            ws = [w.detach() for w, _ in group]
            if device.type == "cuda" and all(w.is_contiguous() for w in ws):
                cast_weights_triton(self._tables_for(ws, [c for _, c in group]))
            else:
                cast_weights_reference(ws, [c.q for _, c in group], [c.s for _, c in group])
            for w, c in group:
                c.cast_done(w)
        self.casts += len(stale)
        return [t for c in copies for t in (c.q, c.s)]

    def _tables_for(self, ws: list[torch.Tensor], copies: list[_Copy]) -> CastTables:
        """Launch tables for these weights and copies, kept by their addresses (what the tables hold):
        equal addresses, equal tables. At most ``TABLES`` are kept (weights passed anew every call, as
        through ``torch.func.functional_call``, would add one each call)."""
        key = (ws[0].dtype, tuple((w.data_ptr(), w.numel(), c.q.data_ptr(), c.s.data_ptr())
                                  for w, c in zip(ws, copies)))
        t = self._tables.pop(key, None)
        if t is None:
            t = CastTables(ws, [c.q for c in copies], [c.s for c in copies])
            if len(self._tables) >= TABLES:
                self._tables.pop(next(iter(self._tables)))
        self._tables[key] = t    # most recently used last
        return t


def weight_positions(gm: fx.GraphModule) -> list[int]:
    """The input positions of the weights whose FP8 copies ``gm``'s trailing inputs take, in their order
    (one per ``q, s`` pair)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    index = {n.name: i for i, n in enumerate(placeholders)}
    return [index[n.meta[META][0]] for n in placeholders if n.meta.get(META, (None, None))[1] == "q"]


def with_copies(casts: Optional[WeightCasts], gm: fx.GraphModule, fn):
    """``fn`` (which runs ``gm``) called with the user's inputs: the FP8 copies ``gm`` takes are made or
    reused (``WeightCasts.inputs_for``) and appended. ``fn`` itself when ``gm`` takes none."""
    positions = weight_positions(gm)
    if not positions or casts is None:
        return fn

    def run(*args):
        return fn(*args, *casts.inputs_for([args[i] for i in positions]))
    return run


def example_inputs(casts: Optional[WeightCasts], gm: fx.GraphModule, args: list) -> list:
    """``args`` and the FP8 copies ``gm`` takes after them, not cast (what compiling ``gm`` needs)."""
    positions = weight_positions(gm)
    return list(args) + (casts.inputs_for([args[i] for i in positions], cast=False) if positions and casts else [])
