"""Op specs: what each fused op declares once, beside its kernels, for everything outside its file.

Each kernel file registers an ``OpSpec`` at import (``register(OpSpec(...))``); importing
``opsmath.kernels`` imports every kernel file, so ``SPECS`` is complete after it. Who reads what:

- ``family``: the rewrite family (pattern name) whose replacement calls the op;
- ``ops`` and ``flops``: the recompute planner's cost model (``opsmath.memory.plan.node_cost``): FLOPs of one
  forward call from its arguments' (fake) values, run at ``efficiency`` times the model's GEMM rate
  (measured); ops without ``flops`` are costed by bytes moved;
- ``inductor_fuses_better`` / ``kept_under_budget``: on a graph Inductor compiles, the family is left to
  Inductor, except under a memory budget when ``kept_under_budget`` (``opsmath.runtime.backend``);
- ``profile``: a class name and substrings of kernel names that ``opsmath.profile`` groups time under;
- ``saves``: what the op keeps for backward, in words (the report's reason where a rewrite keeps more);
- ``workspace``: bytes the op allocates beyond its outputs while it runs, from its arguments' (fake)
  values; the recompute planner holds them at the end of the forward (``opsmath.memory.segments.node_workspace``);
- ``exercise(dtype)``: runs the op forward and backward once with every flag and launch configuration
  it has (tiny sizes), so that ``tests/test_kernels_compile_for_hopper.py`` compiles each launch for sm_90
  (ops with ``triton=False`` run PyTorch's kernels and have no launch of their own to compile).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class OpSpec:
    family: str
    ops: tuple = ()
    flops: Optional[Callable[..., float]] = None
    efficiency: float = 1.0       # its kernels' FLOP rate as a share of the GEMM rate the cost model assumes
    inductor_fuses_better: bool = False
    kept_under_budget: bool = False
    profile: Optional[tuple[str, tuple[str, ...]]] = None
    saves: str = ""
    exercise: Optional[Callable[[torch.dtype], None]] = None
    triton: bool = True           # its kernels are Triton's (else torch's own, e.g. a grouped GEMM)
    workspace: Optional[Callable[..., int]] = None


SPECS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.family in SPECS and SPECS[spec.family] != spec:
        raise ValueError(f"op spec {spec.family!r} registered twice")
    SPECS[spec.family] = spec
    return spec


def spec_of(target) -> Optional[OpSpec]:
    """The spec whose ``ops`` include the graph target ``target`` (an OpOverload), if any."""
    for spec in SPECS.values():
        if target in spec.ops:
            return spec
    return None


def leaf(*shape, dtype=torch.float32) -> torch.Tensor:
    """A random leaf tensor that requires grad (for ``exercise``)."""
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def backward(out: torch.Tensor) -> None:
    """Run a backward through ``out`` with a non-trivial upstream gradient (for ``exercise``)."""
    (out.float() * 0.5).sum().backward()
