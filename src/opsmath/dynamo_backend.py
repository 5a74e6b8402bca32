"""opsmath as a registered dynamo backend: ``torch.compile(model, backend="opsmath", options={...})``.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so projects that take a
backend name (torchtitan, torchtune, HF Accelerate's dynamo plugin, Lightning) reach the same pipeline as
``opsmath.optimize``: capture, rewrites, recompute plan, Inductor on CUDA. ``options`` takes ``optimize``'s
keyword arguments (``memory_budget``, ``patterns``, ``skip``, ``analyze``, ``inductor``, ``fp8``).

What the backend path cannot do, since a backend sees graphs, not the module: a family's ``prepare`` (HF
experts switched from ``"eager"`` to ``"grouped_mm"``) does not run, module hooks are not guarded, a memory
budget is planned per graph (not re-balanced over a step's graphs), and ``cuda_graphs`` is refused (use
``optimize(..., cuda_graphs=True)``). The state of one ``torch.compile`` call lives on its backend
wrapper, where ``opsmath.report(compiled)`` finds it.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.fx as fx

OPTIONS = ("memory_budget", "patterns", "skip", "analyze", "inductor", "fp8")


class GraphInputs:
    """What the pipeline asks of "the model" (``buffers``, ``parameters``, ``training``), read from one
    dynamo graph's inputs: parameters are the ``nn.Parameter`` inputs, buffers the inputs dynamo sourced
    from a module's ``_buffers``; training means gradients are on (train/eval is not visible here)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._params = [x for x in example_inputs if isinstance(x, torch.nn.Parameter)]
        self._buffers = [x for n, x in zip(placeholders, example_inputs)
                         if isinstance(x, torch.Tensor) and "._buffers[" in _source_name(n)]
        self.training = torch.is_grad_enabled()

    def parameters(self):
        return iter(self._params)

    def buffers(self):
        return iter(self._buffers)


def _source_name(node: fx.Node) -> str:
    arg = node.meta.get("grapharg")
    name = getattr(getattr(arg, "source", None), "name", "")
    return (name() if callable(name) else name) or ""


def opsmath_backend(gm: fx.GraphModule, example_inputs, options: Optional[dict] = None, mode: Optional[str] = None):
    """The ``torch_dynamo_backends`` entry: one dynamo graph in, the callable that runs it out."""
    from opsmath.runtime.backend import make_backend
    owner = _compile_wrapper()
    state = getattr(owner, "_opsmath_state", None)
    if state is None:
        state = _state(options or {}, mode)
        if owner is not None:
            owner._opsmath_state = state
    return make_backend(state, GraphInputs(gm, list(example_inputs)))(gm, example_inputs)


def _state(options: dict, mode: Optional[str]):
    from opsmath.api import new_state
    unknown = sorted(set(options) - set(OPTIONS))
    if "cuda_graphs" in unknown or mode in ("reduce-overhead", "max-autotune"):
        raise ValueError("backend='opsmath' does not replay CUDA graphs nor take modes: use "
                         "opsmath.optimize(model, cuda_graphs=True)")
    if unknown:
        raise ValueError(f"backend='opsmath' got unknown options {unknown}; it takes {list(OPTIONS)}")
    o = {**dict(memory_budget=None, patterns=None, skip=None, analyze=True, inductor=None, fp8=False), **options}
    return new_state("torch.compile(backend='opsmath')", o["memory_budget"], o["patterns"], o["skip"],
                     o["analyze"], o["inductor"], False, o["fp8"])


def _compile_wrapper():
    """The ``torch.compile`` call's backend wrapper calling us (one per ``torch.compile``), or None when
    the backend is called another way (then each graph gets a state of its own)."""
    caller = sys._getframe(2).f_locals.get("self")
    return caller if type(caller).__name__ == "_TorchCompileWrapper" else None
