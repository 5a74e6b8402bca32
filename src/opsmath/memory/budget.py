"""Memory budgets: how a user's ``memory_budget`` is read (bytes, a size string, a fraction or a
percentage of the unconstrained activation bytes), the error for one the plan cannot reach, the bytes a
step holds, and a fraction's share held across the graphs of one step."""
from __future__ import annotations

import math
import os
import re

import torch

from opsmath.optim.footprint import eight_bit_lever, state_to_come, steps_in_backward

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(budget) -> tuple[str, float]:
    """``("bytes", n)`` for an int (or an integral float such as ``6e9``) or a size string such as
    ``"6GB"``, ``"6GiB"``, ``"512MiB"``, ``"6e9"``; ``("fraction", f)`` for a float in (0, 1], a
    unitless string such as ``"0.5"`` or a percentage such as ``"50%"`` (of the unconstrained
    activation memory). Anything else is a ``ValueError`` that says what is accepted."""
    import numbers
    if isinstance(budget, bool):
        raise ValueError(f"memory_budget must be bytes, a size string or a fraction, got {budget!r}")
    if isinstance(budget, numbers.Integral):
        if budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {budget}")
        return "bytes", float(budget)
    if isinstance(budget, numbers.Real):
        budget = float(budget)
        if budget > 1.0 and budget.is_integer():   # 6e9: bytes written as a float
            return "bytes", budget
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"a fractional memory_budget must be in (0, 1], got {budget} "
                             "(bytes are an int such as 6 * 2**30, or a string such as '6GiB')")
        return "fraction", budget
    if isinstance(budget, str):
        text = budget.strip().lower()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(%|[kmgt]i?b?|b)?", text)
        if m:
            value, unit = float(m.group(1)), m.group(2)
            if unit == "%":
                if not 0 < value <= 100:
                    raise ValueError(f"a percentage memory_budget must be in (0%, 100%], got {budget!r}")
                return "fraction", value / 100
            if unit is None and "." in text and value <= 1.0:   # "0.5", "1.0": a fraction, as a CLI flag gives it
                return parse_budget(value)
            if unit is None and not value.is_integer():
                raise ValueError(f"cannot read memory_budget {budget!r}: a unitless number is bytes (an integer) "
                                 "or a fraction in (0, 1]")
            unit = (unit or "b") if (unit or "b").endswith("b") else unit + "b"
            if unit in _UNITS and value > 0:
                return "bytes", value * _UNITS[unit]
    raise ValueError(f"cannot read memory_budget {budget!r}: use bytes (int), '6GB', '6GiB', '512MiB' "
                     "or a fraction in (0, 1] such as 0.5 or '50%'")


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (``1000 B``, ``1.46 GiB``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fraction_up(x: float) -> str:
    """A fraction to three decimals, rounded up: the smallest feasible fraction an error names must be one
    that is feasible when asked for (0.3004 reads 0.301, not 0.300)."""
    return f"{math.ceil(x * 1000 - 1e-9) / 1000:.3f}"


class InfeasibleBudget(ValueError):
    """A budget below the smallest the plan can reach; ``floor``: that smallest, in bytes."""

    def __init__(self, message: str, floor: int = 0):
        super().__init__(message)
        self.floor = floor


def cuda_device(tensors) -> "torch.device | None":
    """The device of the first CUDA tensor among ``tensors`` (a graph's inputs), None off CUDA."""
    return next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda), None)


def resident_bytes(example_inputs: list, model: torch.nn.Module) -> int:
    """What stays resident through the step. On CUDA: everything allocated now (weights or their
    FSDP shards, optimizer state, inputs) plus the gradients backward will allocate. On CPU: the model's
    parameters counted by their local shards (an FSDP2 ``DTensor`` counts its ``to_local()`` part)
    twice, for weights and gradients (where an optimizer steps inside backward, the gradients of this
    graph's own parameters only), plus the graph inputs that are not parameters."""
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    cuda = [t for t in tensors if t.is_cuda]
    if cuda:
        grads_to_come = sum(t.numel() * t.element_size() for t in tensors
                            if t.requires_grad and t.is_leaf and t.grad is None)
        return torch.cuda.memory_allocated(cuda[0].device) + grads_to_come

    def local_bytes(p):
        p = p.to_local() if hasattr(p, "to_local") else p
        return p.numel() * p.element_size()
    weights = sum(local_bytes(p) for p in model.parameters())
    # stepped inside backward, a graph's own parameters' gradients are the ones alive with its activations
    grads = sum(local_bytes(t) for t in tensors if isinstance(t, torch.nn.Parameter) and t.requires_grad) \
        if steps_in_backward(model.parameters()) else weights
    return weights + grads + sum(t.numel() * t.element_size() for t in tensors if not t.requires_grad)


def optimizer_state_to_come(example_inputs: list, model: torch.nn.Module, stepped: bool) -> int:
    """On CUDA before any step of this model ran (``stepped`` False): the optimizer state its first
    ``step()`` will allocate (``opsmath.optim.footprint``), which the resident bytes of step 1 lack, so
    that a plan counting it holds at step 1 for what step 2 holds. 0 off CUDA, where the resident bytes
    are a model without optimizer state at every call."""
    on_cuda = cuda_device(example_inputs) is not None
    return state_to_come(model.parameters())[0] if on_cuda and not stepped else 0


def share_budget(budget, share, resident: int):
    """A block piece's byte budget (``runtime/blocks.py``: an optimizer stepping inside backward, one graph
    per block): the ``resident`` bytes at its first call (the earlier pieces' kept activations among
    them) plus its share of the budget's headroom, ``own / (own + later)`` by ``share = (own, later,
    handed, reserve)``, the weights of the piece and of the pieces after it. The headroom is the budget
    less the resident bytes, less ``handed`` (the tensors this piece and the later ones hand on: a
    residual stream, rotary tables, alive beyond their piece and in no piece's plan) and less ``reserve``
    (what the later pieces need at their floors, ``runtime.budgets.reserve_floors``). None where no share applies
    (a fraction, the last piece, a graph that is not a block's piece): the budget itself."""
    kind, value = parse_budget(budget)
    if share is None or kind != "bytes" or min(share[:2]) <= 0:
        return None
    own, later, *kept_back = share
    headroom = max(0.0, value - resident - sum(kept_back))
    return int(resident + headroom * own / (own + later))


def optimizer_lever(model: torch.nn.Module, to_come: int) -> tuple:
    """What the first plan may trade for a budget it cannot meet: 8-bit state for the optimizers that
    allow it (``eight_bit_lever``), while their state is still to come (``to_come`` counted)."""
    return eight_bit_lever(model.parameters()) if to_come else (0, None)


def grad_bytes(gm, example_inputs: list) -> dict[str, int]:
    """The bytes of the gradient backward will allocate for each input of ``gm`` that needs one and has
    none yet (a parameter, by its placeholder's name): what ``resident_bytes`` counts ahead of backward."""
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    return {name: t.numel() * t.element_size() for name, t in zip(names, example_inputs)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf and t.grad is None}


# a fractional budget may end up this far above its target (as a share of the step's activations) when a
# graph's own floor is above its share: a small loss graph after the model's, which keeps all it saves
STEP_SLACK = 0.01


def step_peak(plans: list) -> int:
    """The activation bytes a step of graphs (``plans`` in forward order) peaks at: everything kept at the
    end of the forward, or, while graph k's backward runs (the later graphs' activations freed by then),
    what graphs 0..k keep plus graph k's recompute transient."""
    peak, kept = 0, 0
    for p in plans:
        peak, kept = max(peak, kept + p.kept + p.transient), kept + p.kept
    return max(peak, kept)


def check_step_share(budget, records: list) -> None:
    """After a model call that captured and planned graphs (``records``: those the call ran): a fraction
    is a share of the whole step's activations, which graphs planned one by one (each keeping less for
    what the earlier ones kept over theirs, or at its floor) may still exceed. Raises InfeasibleBudget
    naming the step's floor in the budget's unit."""
    kind, value = parse_budget(budget)
    plans = [r.plan for r in sorted(records, key=lambda r: r.index) if r.plan is not None]
    total = sum(p.unconstrained for p in plans)
    if kind != "fraction" or not total:
        return
    peak = step_peak(plans)
    share = peak / total
    if share > value + STEP_SLACK:
        floor = max(p.resident for p in plans) + peak
        raise InfeasibleBudget(
            f"memory budget {value:.4g} (fraction) cannot be met: the smallest feasible is about {_size(floor)} "
            f"({floor} bytes, fraction {fraction_up(share)})" + (
                f" over the step's {len(plans)} graphs (split by graph breaks), each at its floor" if len(plans) > 1
                else ""),
            floor)


def expandable_segments(example_inputs: list, budget, cuda_graphs: bool) -> str:
    """For a byte budget on CUDA: the caching allocator's expandable segments, so that what it reserves
    stays near what is allocated (a fixed-size segment split by blocks of other sizes cannot be reused
    for a larger one; on an emulated 16 GiB card HF LLaMA 1.1B failed with 1.14 GiB reserved and free).
    New segments from here on; left as the user set it where ``PYTORCH_CUDA_ALLOC_CONF`` names it, and
    off with ``OPSMATH_EXPANDABLE_SEGMENTS=0``; not beside ``cuda_graphs`` (their private pools) nor for a
    fraction. Returns what the report says ("" when nothing changed)."""
    if cuda_graphs or parse_budget(budget)[0] != "bytes" or cuda_device(example_inputs) is None:
        return ""
    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") \
            or os.environ.get("OPSMATH_EXPANDABLE_SEGMENTS", "1") == "0":
        return ""
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return "the allocator's expandable segments turned on (reserved memory stays near allocated)"
