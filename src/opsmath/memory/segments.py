"""Segments of a captured graph for the recompute plan (``opsmath.memory.plan``): sizes, modelled costs, and
the two ways of cutting the forward order into candidate segments.

* **Cost**: a modelled recompute time per node: matmul FLOPs at 400 TFLOP/s, a fused op's FLOPs at its
  op spec's measured share of that (attention, vendor SDPA included: a third), every other op's bytes at
  3 TB/s (about 55% and 75% of the H200 ceilings in docs/design.md), plus 5 us per launch; views cost
  nothing. With ``OPSMATH_MEASURED_COSTS=1`` and the graph on a GPU, each op's time measured there
  replaces the model (``op_times.annotate``).
* **opsmath's cut points** (``segments_of``): the places in the forward order where the activations
  crossing the cut are fewest (local minima of the crossing bytes, e.g. the residual stream between
  blocks). Checkpointing a segment keeps only its external activation inputs and recomputes the rest in
  backward; its saving is ``saved(segment) - inputs(segment)``.
* **The user's checkpoint regions** (``user_segments``): where the model checkpoints its own layers and a
  memory budget hands them to the plan, each region (its inlined nodes, marked
  ``meta["custom"][USER_REGION]``) is one candidate segment, exactly as the user cut it, and the forward
  order between regions is cut at opsmath's points. The plan solves both and keeps the cheaper.
"""
from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx as fx

from opsmath.meta_keys import USER_REGION
from opsmath.kernels import spec_of

from opsmath.rewrite.canonicalize import aten, size_hint
from opsmath.memory.op_times import MEASURED

_FLOP_RATE, _BYTE_RATE, _LAUNCH_S = 400e12, 3e12, 5e-6


def _nbytes(node) -> int:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return size_hint(v.untyped_storage().nbytes())
    if isinstance(v, (tuple, list)):
        return sum(size_hint(t.untyped_storage().nbytes()) for t in v if isinstance(t, torch.Tensor))
    return 0


def _storage(node) -> object:
    """What a kept input holds alive: its storage (views of one buffer hold the same), else the node."""
    v = node.meta.get("val")
    return v.untyped_storage()._cdata if isinstance(v, torch.Tensor) else node


def _input_bytes(ext) -> int:
    """Bytes a checkpoint keeps for its external inputs ``ext``: each storage once."""
    return sum(_nbytes(n) for n in {_storage(n): n for n in ext}.values())


GEMMS = (aten.linear.default, aten.matmul.default, aten.mm.default, aten.bmm.default, aten.addmm.default,
         aten.baddbmm.default)


# PyTorch's own attention where opsmath left it (a mask it declines, the op-by-op path): priced and kept as
# opsmath's attention op is (its op spec's FLOPs and efficiency)
SDPA = (aten.scaled_dot_product_attention.default,)


def is_compute(target) -> bool:
    """A GEMM, or a fused op with GEMMs inside (its op spec counts FLOPs, or PyTorch's SDPA): what a
    selective plan keeps."""
    spec = spec_of(target)
    return target in GEMMS or target in SDPA or (spec is not None and spec.flops is not None)


def _sdpa_flops(n: fx.Node) -> float:
    """FLOPs of an ``aten.scaled_dot_product_attention`` node by the attention op spec's count."""
    q, k, v = _arg_values(n)[:3]
    causal = n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False)
    return spec_of(torch.ops.opsmath.attention.default).flops(q, k, v, None, bool(causal))


def node_cost(n: fx.Node) -> float:
    """Modelled seconds to recompute ``n`` (see module docstring)."""
    if n.op != "call_function" or n.target is operator.getitem or getattr(n.target, "is_view", False):
        return 0.0   # a view launches nothing and moves nothing
    if MEASURED in n.meta:   # its GPU time, measured on its device (op_times.annotate)
        return n.meta[MEASURED]
    out = n.meta.get("val")
    t = _LAUNCH_S
    if n.target in GEMMS[:5] and isinstance(out, torch.Tensor):
        a = n.args[1] if n.target is aten.addmm.default else n.args[0]
        k = a.meta["val"].shape[-1] if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) else 1
        return t + 2 * out.numel() * k / _FLOP_RATE
    spec = spec_of(n.target)
    if spec is not None and spec.flops is not None:    # a fused op with GEMMs inside (its op spec)
        return t + spec.flops(*_arg_values(n)) / (_FLOP_RATE * spec.efficiency)
    if n.target in SDPA:
        return t + _sdpa_flops(n) / (_FLOP_RATE * spec_of(torch.ops.opsmath.attention.default).efficiency)
    moved = _nbytes(n) + sum(_nbytes(i) for i in n.all_input_nodes if i.op != "get_attr")
    return t + moved / _BYTE_RATE


def _arg_values(n: fx.Node) -> list:
    """``n``'s positional arguments, nodes replaced by their (fake) values: what op-spec callables take."""
    return [a.meta.get("val") if isinstance(a, fx.Node) else a for a in n.args]


def node_workspace(n: fx.Node) -> int:
    """Bytes ``n``'s op allocates beyond its outputs while it runs (its op spec's ``workspace``; 0 for
    ATen ops, whose temporaries the measured error covers)."""
    spec = spec_of(n.target) if n.op == "call_function" else None
    if spec is None or spec.workspace is None:
        return 0
    try:
        return int(spec.workspace(*_arg_values(n)))
    except (AttributeError, TypeError, ValueError):   # an argument without a fake value
        return 0


@dataclass
class Segment:
    start: int                 # positions in the forward order, inclusive
    end: int
    saved: int                 # activation bytes its nodes save
    inputs: int                # activation bytes it would keep as checkpoint inputs
    cost: float                # modelled recompute seconds
    fixed: bool = False        # only pinned nodes (``pinned_positions``): never recomputed
    casts: int = 0             # of ``saved``, parameters' low-precision copies (``weight_casts``)
    cast_cost: float = 0.0     # modelled seconds to recompute those copies (memory-bound, as node_cost)
    only: frozenset | None = None   # the nodes a selective run recomputes, where not all its cheap ones
    reads: frozenset = frozenset()   # (position, name) of saved producers before it that it assumes kept

    @property
    def saving(self) -> int:
        return max(0, self.saved - self.inputs)



def describe(order: list[fx.Node], seg: Segment) -> str:
    """What ``seg`` spans, for the report: ``first..last: op xN, ...`` (the ops that cost time)."""
    ops = Counter(str(getattr(n.target, "__name__", n.target)).split(".")[0]
                  for n in order[seg.start:seg.end + 1] if node_cost(n) > 0)
    return (f"{order[seg.start].name}..{order[seg.end].name}: "
            + ", ".join(f"{k} x{v}" if v > 1 else k for k, v in ops.most_common()))


def _arg(n: fx.Node, i: int, name: str):
    return n.args[i] if i < len(n.args) else n.kwargs.get(name)


# norms that update running statistics in place when training, with no alias annotation in their schema:
# target -> (the training flag's position, the statistics' positions)
_STAT_UPDATES = {getattr(aten, name).default: (5, (3, 4)) for name in
                 ("batch_norm", "instance_norm", "native_batch_norm", "cudnn_batch_norm") if hasattr(aten, name)}


def _root(v: fx.Node) -> fx.Node:
    """The node whose tensor ``v`` is, or views (followed through ops whose output aliases their input)."""
    while v.op == "call_function" and isinstance(v.args[0] if v.args else None, fx.Node):
        schema = getattr(v.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            break
        v = v.args[0]
    return v


def mutates_state(n: fx.Node) -> bool:
    """Whether ``n`` writes to a graph input (a buffer, a parameter, a user input) or a view of one: an
    in-place or ``out=`` op on it, or a batch/instance norm updating its running statistics in training
    (BatchNorm, an EMA, spectral norm's power iteration). Run again by a checkpoint's recompute, the
    update would be applied twice (PyTorch stops it: a saved tensor's version changed)."""
    if n.op != "call_function":
        return False
    if n.target in _STAT_UPDATES:
        flag, stats = _STAT_UPDATES[n.target]
        return bool(_arg(n, flag, "training")) and any(isinstance(_arg(n, i, ""), fx.Node) for i in stats)
    schema = getattr(n.target, "_schema", None)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.alias_info is not None and a.alias_info.is_write:
            v = n.kwargs.get(a.name) if a.kwarg_only else _arg(n, i, a.name)
            if isinstance(v, fx.Node) and _root(v).op in ("placeholder", "get_attr"):
                return True
    return False


# calls that switch global state for the nodes after them: split by a cut, a recompute would run part
# of a region in the wrong mode (under checkpoint's enable_grad instead of the model's no_grad)
_MODE_SWITCHES = {torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast,
                  torch.amp.autocast_mode._exit_autocast}


def pinned_positions(order: list[fx.Node]) -> frozenset[int]:
    """Positions a plan run op by op must never recompute: state updates (``mutates_state``), mode
    switches, and what runs with gradients off (it saves nothing; run again, it would run with them on)."""
    out, grad = set(), True
    for i, n in enumerate(order):
        if n.target in _MODE_SWITCHES:
            out.add(i)
            grad = bool(n.args[0]) if n.target is torch._C._set_grad_enabled else grad
        elif not grad or mutates_state(n):
            out.add(i)
    return frozenset(out)


def forward_order(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _crossing_cuts(order: list[fx.Node], window: int) -> list[int]:
    """Positions i (cut after order[i]) at local minima of the activation bytes crossing them."""
    pos = {n: i for i, n in enumerate(order)}
    last_use = {n: max((pos.get(u, len(order)) for u in n.users), default=pos[n]) for n in order}
    crossing = [0] * len(order)
    for n in order:
        b = _nbytes(n)
        for i in range(pos[n], min(last_use[n], len(order))):
            crossing[i] += b
    cuts = []
    for i in range(len(order) - 1):
        lo, hi = max(0, i - window), min(len(order) - 1, i + window)
        if crossing[i] > min(crossing[lo:hi + 1]):
            continue
        if cuts and i - cuts[-1] < 3:      # two minima close together: the lower one (ties: the first)
            if crossing[i] < crossing[cuts[-1]]:
                cuts[-1] = i
        else:
            cuts.append(i)
    return cuts


def _segments(order: list[fx.Node], cuts: list[int], saved_by: dict[str, int],
              pinned: frozenset = frozenset()) -> list[Segment]:
    """Segments between ``cuts``; each run of ``pinned`` positions (``pinned_positions``) cut out as a
    segment of its own, marked ``fixed``."""
    edges = [i for i in pinned if i - 1 not in pinned] + [i + 1 for i in pinned if i + 1 not in pinned]
    cuts = [*cuts, *(c - 1 for c in edges if 0 < c < len(order))]
    bounds = [-1] + sorted(set(cuts)) + [len(order) - 1]
    segs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        nodes = order[a + 1:b + 1]
        if not nodes:
            continue
        inside = set(nodes)
        ext = {i for n in nodes for i in n.all_input_nodes if i not in inside and i.op == "call_function"}
        casts = [c for n in nodes if (c := getattr(saved_by, "casts", {}).get(n.name, 0))]
        segs.append(Segment(a + 1, b, sum(saved_by.get(n.name, 0) for n in nodes),
                            _input_bytes(ext), sum(node_cost(n) for n in nodes),
                            fixed=all(i in pinned for i in range(a + 1, b + 1)), casts=sum(casts),
                            # a launch each; the fp32 weight read (twice the copy's bytes) and the copy written
                            cast_cost=len(casts) * _LAUNCH_S + 3 * sum(casts) / _BYTE_RATE))
    return segs


def segments_of(gm: fx.GraphModule, saved_by: dict[str, int], window: int = 6,
                pinned: frozenset = frozenset()) -> list[Segment]:
    """Cut the forward order at local minima of the activation bytes crossing each position; ``pinned``
    positions (a plan run op by op: ``pinned_positions``) are fixed segments of their own."""
    order = forward_order(gm)
    return _segments(order, _crossing_cuts(order, window), saved_by, pinned)


def user_regions(order: list[fx.Node]) -> list[tuple[int, int]]:
    """(first, last) positions of each inlined user checkpoint region in ``order``, in order."""
    spans: dict = {}
    for i, n in enumerate(order):
        r = (n.meta.get("custom") or {}).get(USER_REGION)
        if r is not None:
            lo, hi = spans.get(r, (i, i))
            spans[r] = (min(lo, i), max(hi, i))
    return sorted(spans.values())


def user_segments(gm: fx.GraphModule, saved_by: dict[str, int], window: int = 6,
                  pinned: frozenset = frozenset()) -> list[Segment] | None:
    """Segments whose candidates are the user's checkpoint regions (each exactly as cut), with the
    order between and around them cut at opsmath's points; None without (disjoint) regions."""
    order = forward_order(gm)
    spans = user_regions(order)
    if not spans or any(a[1] >= b[0] for a, b in zip(spans, spans[1:])):
        return None
    cuts = [i for i in _crossing_cuts(order, window) if not any(lo - 1 <= i <= hi for lo, hi in spans)]
    for lo, hi in spans:
        cuts += [lo - 1, hi] if lo > 0 else [hi]
    return _segments(order, [c for c in cuts if c < len(order) - 1], saved_by, pinned)


def runs_of(gm: fx.GraphModule, segs: list[Segment], max_len: int = 16) -> dict[tuple[int, int], Segment]:
    """Every run of up to ``max_len`` consecutive segments i..j as one candidate (merged) segment: saved
    and cost summed, inputs the external activation inputs of the union, each storage counted once (a
    tensor two segments of the run read, or two views of one buffer, is kept once). Merging adjacent segments trades a larger
    recomputation for fewer kept boundary tensors, which is how a plan reaches a per-block floor."""
    order = forward_order(gm)
    pos = {n: k for k, n in enumerate(order)}
    runs = {}
    for i in range(len(segs)):
        start, held, inputs, saved, cost, casts, cast_cost = segs[i].start, set(), 0, 0, 0.0, 0, 0.0
        for j in range(i, min(len(segs), i + max_len)):
            s = segs[j]
            if s.fixed:
                break
            for n in order[s.start:s.end + 1]:
                for x in n.all_input_nodes:
                    if x.op == "call_function" and pos.get(x, start) < start and _storage(x) not in held:
                        held.add(_storage(x))
                        inputs += _nbytes(x)
            saved, cost, casts, cast_cost = saved + s.saved, cost + s.cost, casts + s.casts, cast_cost + s.cast_cost
            runs[(i, j)] = Segment(start, s.end, saved, inputs, cost, casts=casts, cast_cost=cast_cost)
    return runs
