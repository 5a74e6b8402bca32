"""Ordinary training loops under CUDA-graph replay (``optimize(cuda_graphs=True)``).

Inductor's CUDA-graph trees keep every replayed graph's outputs in one private memory pool. When a call
starts a new step (no backward pending, or after ``cudagraph_mark_step_begin``) the pool is handed to the
new replay, and any tensor still held from the previous step is marked: reading it raises "accessing
tensor output of CUDAGraphs that has been overwritten by a subsequent run". ``torch.compile(mode=
"reduce-overhead")`` leaves that to the user. Two ordinary loops meet it:

- gradient accumulation, ``zero_grad(set_to_none=False)``, or an evaluation forward between backward and
  the optimizer step: AccumulateGrad *steals* the compiled backward's gradient as ``param.grad`` (no
  copy), so ``.grad`` lives in the pool, and the next replay overwrites it before it is read or added to;
- a loss kept across steps (``losses.append(loss)``, averaged at the end of an epoch).

``StepGuard`` keeps both without the user's help:

- ``before_call()``, at every call of an optimized model (before any of its graphs replay): each
  parameter's ``.grad`` whose storage is a live output of the pool's current path is replaced by a copy
  in ordinary memory, for every model optimized with ``cuda_graphs=True`` in the process (a GAN's two
  models replay into one pool). A loop that sets gradients to ``None`` each step copies nothing;
  gradient accumulation copies each gradient once per optimizer step (the first micro-batch's), after
  which AccumulateGrad adds into the copy in place.
- ``after_call(out)``: outputs of at most ``SMALL_OUTPUT_BYTES`` whose storage is in the pool (a loss, a
  metric) are returned as copies, one small kernel each. Larger outputs (logits) stay in the pool, as
  under ``reduce-overhead``: kept past the next step's forward, they must be cloned by the user (the
  report says so).

Inductor leaves some graphs without CUDA graphs (CPU tensors, dynamic shapes, input mutation) and logs
why on its ``cudagraphs`` log; ``_SkipReasons`` hands those reasons to the report of every live model
optimized with ``cuda_graphs=True``.

What it reads of the trees (``get_manager``, ``current_node.path_live_weakrefs()``) is private PyTorch
API; where it is missing the guard does nothing and the trees' own error stands.
"""
from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch
from torch.utils._pytree import tree_map_only

SMALL_OUTPUT_BYTES = 1 << 20
CUDA_GRAPHS_NOTE = ("CUDA graphs: gradients and outputs up to 1 MiB are kept out of the replay pool; clone a "
                    "larger output (logits) kept past the next step's forward")

# model -> (how many graphs it had compiled, its parameters then): walking ``parameters()`` costs about
# 180 us a call at GPT-2-small's 148 tensors, on the host path CUDA graphs exist to shorten. A parameter
# added later is used by a new graph, so the list is renewed when the model's graph count changes (a
# parameter replaced by another object of the same shape, which dynamo need not recompile for, is not).
_GUARDED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
# where Inductor says why a graph is not replayed as a CUDA graph (its "cudagraphs" log artifact)
SKIP_LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"


class _SkipReasons(logging.Handler):
    """Inductor's reasons for not replaying a graph (CPU tensors, dynamic shapes, input mutation),
    handed to every live model optimized with ``cuda_graphs=True`` for its report."""
    states: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()   # id -> OptimizeState

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(("skipping cudagraphs", "disabling cudagraphs")):
            for state in list(self.states.values()):
                if msg not in state.cuda_graph_skips:
                    state.cuda_graph_skips.append(msg)


_SKIPS = _SkipReasons()


def _pool_storages(device: torch.device) -> list[frozenset]:
    """For each graph on the current CUDA-graph path of ``device``, the data pointers of its outputs
    (pool memory: the trees' private pool never serves other allocations). Empty when nothing has
    replayed there, or the trees' API is not what this module reads. A recorded graph's outputs sit at
    fixed addresses, so its set is computed once."""
    try:
        from torch._inductor import cudagraph_trees as trees
        manager = trees.get_manager(device.index if device.index is not None else torch.cuda.current_device(),
                                    create_if_none_exists=False)
        node = manager.current_node if manager is not None else None
        return [] if node is None else [_output_pointers(n, trees) for n in node._path_from_root]
    except (ImportError, AttributeError, KeyError, RuntimeError):
        return []


_RECORDED: "weakref.WeakKeyDictionary[object, frozenset]" = weakref.WeakKeyDictionary()


def _output_pointers(node, trees) -> frozenset:
    ptrs = _RECORDED.get(node)
    if ptrs is None:
        ptrs = frozenset(ref.data_ptr() for ref in node.outputs_weakrefs if ref is not None)
        if isinstance(node, trees.CUDAGraphNode):   # warm-up runs allocate afresh each time
            _RECORDED[node] = ptrs
    return ptrs


def _parameters(model: torch.nn.Module) -> list:
    """``model``'s parameters, listed again only when it has compiled another graph (``_GUARDED``)."""
    graphs = len(getattr(getattr(model, "_opsmath", None), "graphs", ()))
    seen, params = _GUARDED.get(model, (-1, []))
    if seen != graphs:
        params = list(model.parameters())
        _GUARDED[model] = (graphs, params)
    return params


def _in_pool(t: torch.Tensor, pools: dict) -> bool:
    if t.device not in pools:
        pools[t.device] = _pool_storages(t.device)
    ptr = t.untyped_storage().data_ptr()
    return any(ptr in s for s in pools[t.device])


class StepGuard:
    """Copies out of the CUDA-graph pool what an ordinary loop reads after the next replay (module doc)."""

    def __init__(self, model: torch.nn.Module, state=None):
        _GUARDED[model] = (-1, [])
        if state is not None:
            _SkipReasons.states[id(state)] = state
            log = logging.getLogger(SKIP_LOGGER)
            if _SKIPS not in log.handlers:
                log.addHandler(_SKIPS)

    @staticmethod
    def before_call() -> int:
        """Move pool-owned ``.grad`` tensors of every guarded model to ordinary memory; how many moved."""
        grads = [(p, getattr(getattr(m, "_opsmath", None), "weight_casts", None))
                 for m in list(_GUARDED.keys()) for p in _parameters(m) if p.grad is not None and p.grad.is_cuda]
        if not grads:
            return 0
        pools: dict = {}
        moved = 0
        for p, casts in grads:
            if _in_pool(p.grad, pools):
                old, p.grad = p.grad, p.grad.clone()
                if casts is not None:   # the FP8 weight copies follow the gradient's accumulation
                    casts.grad_replaced(p, old, p.grad)
                moved += 1
        return moved

    @staticmethod
    def after_call(out):
        """``out`` with its small pool-owned tensors replaced by copies (autograd flows through them)."""
        pools: dict = {}

        def small_copy(t: torch.Tensor) -> torch.Tensor:
            if not t.is_cuda or t.untyped_storage().nbytes() > SMALL_OUTPUT_BYTES:
                return t
            return t.clone() if _in_pool(t, pools) else t
        return tree_map_only(torch.Tensor, small_copy, out)


def guard_for(model: torch.nn.Module, state) -> Optional[StepGuard]:
    """The step guard of a model optimized with ``cuda_graphs=True`` (``state``: its OptimizeState,
    whose ``cuda_graph_skips`` collects Inductor's reasons for graphs it does not replay)."""
    return StepGuard(model, state) if state.cuda_graphs else None
