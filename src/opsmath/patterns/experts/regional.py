"""Expert loops traced once per module class, not once per layer.

Dynamo traces a loop over experts one ``torch.where`` at a time, each a data-dependent (unbacked) size,
and lowering traces it again: about 0.1 s per expert per layer on a 2-core CPU (a 64-expert, 8-layer
model: 55 s of tracing before its first step, where ``torch.compile``, which breaks the graph at every
``torch.where``, reuses its pieces across experts and layers). Where a model repeats such a module
(``REGIONAL_EXPERTS`` experts over all its instances, or more), each instance's call becomes a graph
break of its own and its ``forward`` a frame of its own: dynamo compiles that frame once, for the first
instance, and every other instance of the class runs the same compiled graph (parameters are graph
inputs, as in torch's regional compilation). The loop is rewritten once.

The cost: the graph is broken around each such module (the blocks' code before and after it runs as
graphs of their own, also compiled once and reused), so Inductor fuses nothing across the boundary, and
each boundary costs the host a graph call. Dynamo cannot resume a frame inside a loop: the frame that
calls the modules from a loop (the loop over layers) runs eagerly, and the ops it runs itself (in the
reference model: the embedding, the LM head and the loss) get no rewrite. Measured on the CPU (64 experts
x 8 layers): first step 7.7 s instead of 45.3 s (``torch.compile``: 27.9 s), steps 4% slower than the one
graph's. Below the threshold (the 8-expert, 8-layer model: 64) the whole model stays one graph. The
report's notes name the modules; their expert-load view pools every instance (one graph).

A checkpoint (``torch.utils.checkpoint``) runs its function with dynamo off: a module called there gets
no graph of its own, and its loop would run as written, where the model's one graph traces the
checkpoint and rewrites the loop inside it. So a model that checkpoints (``_checkpoints``) is left one
graph, and a module found running with dynamo off anyway is logged and named in the report
(``eager_notes``).
"""
from __future__ import annotations

import inspect
import logging
import os
import types
from collections import defaultdict

import torch
try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
except ImportError:     # a torch without it: modules under a checkpoint are not detected at run time
    def get_eval_frame_callback():
        return True

log = logging.getLogger("opsmath")

REGIONAL_EXPERTS = 256   # experts x instances from which a module's loop is traced once for all instances


def threshold() -> float:
    """``REGIONAL_EXPERTS``, or the environment's ``OPSMATH_REGIONAL_EXPERTS`` (0: every model one graph,
    for long runs where the steps' few percent outweigh the first step's tracing)."""
    raw = os.environ.get("OPSMATH_REGIONAL_EXPERTS", REGIONAL_EXPERTS)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"OPSMATH_REGIONAL_EXPERTS={raw!r}: an integer number of experts (0: never)") from None
    return value if value > 0 else float("inf")


def expert_lists(module: torch.nn.Module) -> int:
    """Experts ``module`` holds as modules, in an ``nn.ModuleList`` child named ``*expert*`` (0: none)."""
    return max([len(child) for name, child in module.named_children()
                if isinstance(child, torch.nn.ModuleList) and len(child) > 1 and "expert" in name.lower()],
               default=0)


ACTIVE: list[str] = []    # the label of the modules whose graph runs (and may be captured) now


_COPIES: dict = {}
_WARNED: set = set()


def forward_copy(forward):
    """``forward`` with a code object of its own (same globals, defaults and closure: the same function).
    Dynamo keeps what it learned per code object, whichever backend compiled it: once ``torch.compile``
    skipped a loop over experts (a graph break in a loop skips the frame), an opsmath frame of the same
    code would be skipped too, and the loop left as written."""
    if forward not in _COPIES:
        fn = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                                forward.__defaults__, forward.__closure__)
        fn.__kwdefaults__, fn.__qualname__ = forward.__kwdefaults__, forward.__qualname__
        _COPIES[forward] = fn
    return _COPIES[forward]


def _own_graph(own: "OwnGraph", *args, **kwargs):
    if get_eval_frame_callback() is None and torch.is_grad_enabled():
        # dynamo is off around this call (``torch.utils.checkpoint`` runs its function so; a
        # ``torch.compiler.disable`` region): no graph of its own can be captured, the loop runs as written
        if own.label not in _WARNED:
            _WARNED.add(own.label)
            log.warning("opsmath: %s ran with dynamo off (inside torch.utils.checkpoint?): its expert loop runs "
                        "as written; OPSMATH_REGIONAL_EXPERTS=0 keeps it in the model's graph", own.label)
        own.eager_calls += 1
    ACTIVE.append(own.label)
    try:
        return forward_copy(type(own.module).forward)(own.module, *args, **kwargs)
    finally:
        ACTIVE.pop()


# skipped by dynamo (a graph break in the caller), while the frame it calls, the module's ``forward``, is
# compiled by the same ``torch.compile`` as the caller's: one cache entry serves every instance
_WHY = "opsmath: a repeated MoE module runs as its own graph, traced once for all (patterns/experts/regional.py)"
try:
    _own_graph = torch._dynamo.disable(_own_graph, recursive=False, reason=_WHY)
except TypeError:   # a torch without disable's reason
    _own_graph = torch._dynamo.disable(_own_graph, recursive=False)


class OwnGraph:
    """An instance's ``forward`` (``module.forward``), the class's ``forward`` behind a graph break;
    ``label`` names the modules that share its graph, for the report while it is captured. Copies and
    pickles of the module carry it bound to themselves (``module`` is an attribute)."""

    def __init__(self, module: torch.nn.Module, label: str):
        self.module, self.label, self.eager_calls = module, label, 0

    def __call__(self, *args, **kwargs):
        return _own_graph(self, *args, **kwargs)


def trace_once(model: torch.nn.Module) -> list[str]:
    """Give each repeated expert-loop module of ``model`` its own graph (``OwnGraph``) where its class has
    ``REGIONAL_EXPERTS`` experts in all, unless the model checkpoints (``_checkpoints``); the report's
    notes for those it did."""
    by_class = defaultdict(list)
    for name, m in model.named_modules():
        # a forward set on the instance stays; a class's forward that is no plain function has no code to copy
        if expert_lists(m) and "forward" not in m.__dict__ and isinstance(type(m).forward, types.FunctionType):
            by_class[type(m)].append((name, m))
    notes = []
    for cls, found in by_class.items():
        experts = sum(expert_lists(m) for _, m in found)
        if len(found) < 2 or experts < threshold():
            continue
        names = [n for n, _ in found]
        label = f"{names[0]} ... {names[-1]}"
        where = _checkpoints(model)
        if where:
            notes.append(f"experts: {len(found)} {cls.__name__} modules ({label}) traced in the model's graph, "
                         f"not once for all: {where} checkpoints, and a checkpoint's function runs with dynamo "
                         "off, where no graph of their own could be captured")
            continue
        for _, m in found:
            m.forward = OwnGraph(m, label)
        notes.append(f"experts: {len(found)} {cls.__name__} modules ({label}, {experts} experts "
                     f"in all) each run as a graph of their own, traced and rewritten once for all of them: a "
                     f"loop over experts traces one data-dependent size per expert. The graph breaks around "
                     f"them: a frame calling them from a loop runs eagerly, its own ops without rewrites "
                     f"(on the H200, 64 experts x 8 layers: steps +25%, peak +30% against one graph; "
                     f"OPSMATH_REGIONAL_EXPERTS=0 keeps one graph, for long runs); their expert-load view "
                     f"pools all {len(found)}")
    return notes


def _checkpoints(model: torch.nn.Module) -> str:
    """Which of ``model``'s modules checkpoint (Hugging Face's ``gradient_checkpointing``, or a
    ``checkpoint(`` call in a ``forward``'s source), else ''."""
    classes = {}
    for name, m in model.named_modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            return name or type(m).__name__
        classes.setdefault(type(m), name)
    for cls, name in classes.items():
        if cls.__module__.startswith("torch."):
            continue
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            continue
        if "checkpoint(" in source:
            return name or cls.__name__
    return ""


def eager_notes(model: torch.nn.Module) -> list[str]:
    """For the report: the shared graphs that ran with dynamo off, so their loops as written."""
    calls = defaultdict(int)
    for m in model.modules():
        own = m.__dict__.get("forward")
        if isinstance(own, OwnGraph):
            calls[own.label] += own.eager_calls
    return [f"experts: {label} ran {n} times with dynamo off (inside torch.utils.checkpoint or a disabled region): "
            "their expert loop ran as written; OPSMATH_REGIONAL_EXPERTS=0 keeps them in the model's graph"
            for label, n in calls.items() if n]
