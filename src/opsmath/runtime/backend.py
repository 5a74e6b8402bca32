"""The dynamo backend behind ``opsmath.optimize``: one captured graph in, the callable that runs it out.

    dynamo graph -> split around eager regions (regions.py) -> for each piece:
        pre-dispatch ATen (capture) -> patterns (match + replace) -> recompute plan -> GraphModule (emit)
        -> Inductor on CUDA, op by op under autograd elsewhere

Each piece is one ``GraphRecord`` of the report. Under a memory budget a piece's plan is checked against
what its first steps measured and made again if needed (``replan.py``).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from opsmath.kernels import SPECS

from opsmath.memory.analysis import DeferredSavedBytes, kernel_launches, saved_bytes_by_node, to_networkx
from opsmath.capture.lower import data_dependent, lower_to_aten, static_inputs
from opsmath.capture.autocast import autocast_inside, hoist_whole_region
from opsmath.capture.guards import after_change, guarded
from opsmath.capture.interrupts import interrupts_deferred
from opsmath.rewrite import price
from opsmath.rewrite.match import Decline, Match, run_patterns
from opsmath.runtime import blocks, cache_key, ladder, offload_async, ttir_cache, wgrad
from opsmath.memory import offload, weight_casts
from opsmath.memory.budget import InfeasibleBudget
from opsmath.runtime.budgets import plan_graph, reserve_floors, step_in_backward
from opsmath.memory.plan import clone_graph_module
from opsmath.memory.replan import runner
from opsmath.capture.regions import (EagerRegion, LazyPiece, compile_functions, eager_nodes, hooks_off_while_tracing,
                                     inline_checkpoint, route_checkpoints, split_around)
from opsmath.capture.loss_head import loss_head, split_loss_head, zero_gradient_note
from opsmath.capture.pieces import symbolic_sizes

log = logging.getLogger("opsmath")


def compile_fx(gm, example_inputs, cuda_graphs: bool = False):
    """Inductor on the rewritten graph; ``cuda_graphs``: with CUDA-graph trees, as ``torch.compile``'s
    ``mode="reduce-overhead"`` sets them up.

    A graph with recompute tags (opsmath's plan, a user's checkpoint) bypasses AOTAutograd's cache: its
    key is the graph's code, and node meta (where the tags live) is not part of it, so a tagged graph
    would be served the partition of an identical graph compiled with other tags or none. Parameters are
    static inputs, as in dynamo's graphs (``capture.static_inputs``)."""
    from torch._inductor.compile_fx import compile_fx as inductor
    ttir_cache.install()
    tagged = any("recompute" in n.meta for n in gm.graph.nodes) or offload.has_offload(gm) \
        or weight_casts.has_marks(gm)
    static_inputs(gm)
    offloading = offload_async.offloading(gm, example_inputs)
    passes = [p for p in (weight_casts.joint_pass(gm, example_inputs), _wgrad_pass(gm, example_inputs)) if p]
    patches = dict(cache_key.patches(), **({"triton.cudagraphs": True} if cuda_graphs else {}))
    if _cpu_gather_with_grad(gm, example_inputs):
        patches["cpp.simdlen"] = 0
    if passes:   # after any joint-graph pass already configured
        patches["joint_custom_post_pass"] = cache_key.JointPasses(
            [torch._inductor.config.joint_custom_post_pass, *passes])
    with torch._functorch.config.patch(enable_autograd_cache=False) if tagged else contextlib.nullcontext(), \
            offloading:
        return inductor(gm, example_inputs, config_patches=patches or None)


def _cpu_gather_with_grad(gm: fx.GraphModule, example_inputs) -> bool:
    """Whether ``gm`` runs on the CPU, takes an input that needs a gradient and gathers rows (an
    embedding, ``w[idx]``), whose backward scatters. Inductor's vectorized C++ code for that scatter,
    fused with the sum of gradients arriving from a matmul or custom op and from a graph output (torch
    2.13 CPU: ``emb = embedding(idx, w)``, returning ``emb`` and ``emb.permute(...) @ q``; T5's position
    bias handed from block to block), gives a wrong ``w.grad`` (relative error ~1), where scalar code is
    right: such graphs are compiled without vectorization (``cpp.simdlen=0``). Read in ATen (the rewritten
    graph) and in dynamo's spelling (its graph, which the fallback ladder compiles)."""
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if not tensors or not all(t.is_cpu for t in tensors) or not any(t.requires_grad for t in tensors):
        return False
    return any(gm.graph.find_nodes(op="call_function", target=t) for t in _GATHERS)


_GATHERS = (torch.ops.aten.embedding.default, torch.ops.aten.index.Tensor, torch.nn.functional.embedding,
            torch.embedding)


def _wgrad_pass(gm: fx.GraphModule, example_inputs):
    """``wgrad``'s joint-graph pass where ``gm`` runs on CUDA (None elsewhere, or where it is off)."""
    if not any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
        return None
    return wgrad.joint_pass(weight_casts.param_positions(gm, example_inputs))


# Families Inductor does better than opsmath's opaque op when it compiles the graph anyway (each op
# spec's ``inductor_fuses_better``, its evidence beside it in src/opsmath/kernels/): skipped by default under
# Inductor; ``patterns=[...]`` still applies them, and the op-by-op path (CPU, ``inductor=False``) keeps
# them. Under a memory budget the families whose spec says ``kept_under_budget`` stay.
INDUCTOR_FUSES_BETTER = {s.family for s in SPECS.values() if s.inductor_fuses_better}
KEPT_UNDER_BUDGET = {s.family for s in SPECS.values() if s.kept_under_budget}


@dataclass
class GraphRecord:
    """One captured graph variant: its code before and after rewriting and what changed."""
    index: int
    training: bool
    input_shapes: list
    before_code: str
    after_code: str
    before_ops: Counter
    after_ops: Counter
    matches: list[Match]
    declines: list[Decline]
    capture_seconds: float
    launches: tuple = (None, None)          # forward kernel launches (estimate), before -> after
    analysis: object = field(default=None, repr=False)   # DeferredSavedBytes: ``saved_bytes`` at first read
    graph: Optional[fx.GraphModule] = field(default=None, repr=False)
    before_nx: object = field(default=None, repr=False)   # networkx.DiGraph of the captured graph
    calls: int = 0                          # how many times the graph ran (one graph can serve many modules)
    last_run: int = 0                       # ``graph_runs`` at its latest call: which graphs ran in one step
    step_peak: Optional[int] = None         # CUDA peak through the measured step's backward (replan.py)
    plan: object = None                     # the recompute Plan under memory_budget (plan.py), if any
    base: object = field(default=None, repr=False)       # the rewritten graph before planning (replan.py)
    saved_by: object = field(default=None, repr=False)   # its saved bytes by node (analysis)
    pending: object = field(default=None, repr=False)    # (plan, graph) to install at its next call
    inductor: bool = False                  # whether the emitted graph was compiled by Inductor
    inductor_seconds: float = 0.0           # of capture_seconds, the time spent in Inductor
    fp32_wgrad: Optional[int] = None        # GEMMs wgrad.py made write fp32 weight gradients (None: pass not on)
    left_to_inductor: list = field(default_factory=list)   # families not applied: Inductor does them better
    cuda_graphs: bool = False               # compiled for CUDA-graph replay (optimize(cuda_graphs=True))
    dynamic: bool = False                   # symbolic sizes: one graph serves every value of a changing dim
    static_only: list = field(default_factory=list)   # families not applied to it: they need static sizes
    left_on_gpu: list = field(default_factory=list)   # rewritten here (op by op), left to Inductor on CUDA
    source: object = field(default=None, repr=False)     # dynamo's graph, unrewritten (the fallback ladder)

    @property
    def saved_bytes(self) -> tuple:
        """Activation bytes saved for backward, before -> after (None where not analyzed), counted at the
        first read (``analysis.DeferredSavedBytes``)."""
        return self.analysis.get() if self.analysis is not None else (None, None)

    def to_dict(self) -> dict:
        saved = self.saved_bytes   # first: counting sets the matches' saved_delta
        return dict(index=self.index, training=self.training, input_shapes=self.input_shapes,
                    before_ops=dict(self.before_ops), after_ops=dict(self.after_ops),
                    matches=[m.to_dict() for m in self.matches], declines=[d.to_dict() for d in self.declines],
                    capture_seconds=self.capture_seconds, calls=self.calls, launches=list(self.launches),
                    saved_bytes=list(saved), plan=self.plan.to_dict() if self.plan else None,
                    inductor=self.inductor, inductor_seconds=self.inductor_seconds, fp32_wgrad=self.fp32_wgrad,
                    left_to_inductor=list(self.left_to_inductor), cuda_graphs=self.cuda_graphs,
                    dynamic=self.dynamic, static_only=list(self.static_only), left_on_gpu=list(self.left_on_gpu),
                    before_code=self.before_code, after_code=self.after_code)


def op_counts(gm: fx.GraphModule) -> Counter:
    """Histogram of call_function targets, named as GraphModule.code names them."""
    c = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            name = str(n.target) if isinstance(n.target, torch._ops.OpOverload) else getattr(n.target, "__name__", str(n.target))
            c[name.replace(".default", "")] += 1
    return c


def make_backend(state, model: torch.nn.Module):
    """The dynamo backend of ``optimize``: ``state`` is the model's ``OptimizeState``."""
    def opsmath_backend(gm: fx.GraphModule, example_inputs):
        # the user's saved-tensor hooks (save_on_cpu, offloading, byte counters) are for the run, not
        # for capture's fake tensors: off while tracing, as dynamo's own AOTAutograd does. Pieces and
        # checkpoint bodies compiled at their first call come back here too (inside a checkpoint's
        # forward, tracing must not reach its hooks: the recompute would save a different count)
        with hooks_off_while_tracing(), interrupts_deferred():
            region = hoist_whole_region(gm)   # Accelerate's autocast around model.forward (capture/autocast.py)
            if region is None:
                return _backend(gm, example_inputs)
            with region.context():
                return region.wrap(_backend(gm, example_inputs))

    def _backend(gm: fx.GraphModule, example_inputs):
        regions = eager_nodes(gm)
        inductor = _uses_inductor(state, example_inputs)
        _inline_checkpoints(state, gm, regions, inductor)
        parts, note = blocks.split_for_optimizer(model, gm, regions)
        if note and inductor and note not in state.notes:   # op by op, gradients arrive one by one anyway
            state.notes.append(note)
        if not regions:
            head = loss_head(gm, list(example_inputs)) if parts is None and inductor and \
                state.memory_budget is None else None
            if inductor:   # (op by op, autograd makes no gradient for an output nothing reads)
                _note(state, zero_gradient_note(gm, head[0] if head else None))
            split = split_loss_head(gm, head) if head else None
            if split is not None:
                parent, pieces, note = split
                _note(state, note)
                return lazy(parent, pieces, symbolic_first=symbolic_sizes(gm))
            if parts is None:
                try:
                    return compile_graph(state, model, gm, list(example_inputs))
                except InfeasibleBudget as e:   # the optimizer may step inside backward: per-block graphs
                    parts = step_in_backward(state, model, gm, e)
            parent, pieces = parts   # one graph per block: its gradients are final at its backward's end
            reserve_floors(state, parent, pieces, inductor, piece_rewrite(state, inductor))
            state.notes.append(f"{len(pieces)} graphs, one per block: the optimizer steps inside backward")
            return lazy(parent, pieces)
        # autograd Functions (compiled by Inductor where the graph is) and tensor hooks run as dynamo
        # traced them, checkpoints as the user wrote them; the pieces between them and the checkpoints'
        # bodies (which may hold regions of their own) go through this backend at their first call
        state.eager_regions.extend(regions.values())
        parent, pieces, alone = split_around(gm, set(regions))
        # sizes that vary: compiled once with symbolic sizes (a budget plans each size exactly)
        lazy(parent, pieces, symbolic_first=symbolic_sizes(gm))
        if _uses_inductor(state, example_inputs):
            compile_functions(parent, regions, alone, compile_fx, state.fallback_errors)
        route_checkpoints(parent, opsmath_backend, state.fallback_errors)
        return parent.forward

    def lazy(parent: fx.GraphModule, pieces: list[str], symbolic_first: bool = False):
        """``parent``'s pieces compiled through this backend at their first call; its forward."""
        for name in pieces:
            setattr(parent, name, LazyPiece(getattr(parent, name), opsmath_backend, state.fallback_errors,
                                            symbolic=state.memory_budget is None, symbolic_first=symbolic_first))
        return parent.forward
    return opsmath_backend


def _note(state, note: Optional[str]) -> None:
    if note and note not in state.notes:
        state.notes.append(note)


def _left_on_gpu(state, use_inductor: bool, matches) -> list[str]:
    """Families rewritten in a graph run op by op because it is on the CPU, which a CUDA run (Inductor
    on by default) would leave to Inductor: what a CPU report (``opsmath report``) must not promise."""
    if use_inductor or state.inductor is not None or not state.default_patterns:
        return []
    return sorted({m.pattern for m in matches} & _left_to_inductor(state))


def _left_to_inductor(state) -> set[str]:
    """The families a graph Inductor compiles leaves to it by default (``patterns=`` not given)."""
    return INDUCTOR_FUSES_BETTER - (KEPT_UNDER_BUDGET if state.memory_budget is not None else set())


def _uses_inductor(state, example_inputs) -> bool:
    """Whether the graph of these inputs is compiled by Inductor (``optimize(inductor=...)``; default:
    when its tensors are on CUDA)."""
    if state.inductor is not None:
        return state.inductor
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)


def _inline_checkpoints(state, gm: fx.GraphModule, regions: dict, use_inductor: bool) -> None:
    """The user's checkpoint regions that can be inlined are, and are taken out of ``regions`` and
    reported: under a memory budget untagged, for opsmath's plan to decide; without one, on a graph
    Inductor compiles, tagged for recompute (the user's choice, kept inside one compiled graph, as
    ``torch.compile`` does). Otherwise they run through ``run_checkpoint`` as written."""
    if state.memory_budget is None and not use_inductor:
        return
    for node, region in list(regions.items()):
        if region.kind != "checkpoint":
            continue
        region_id = next(_CHECKPOINT_IDS)
        tag = None if state.memory_budget is not None else region_id
        if inline_checkpoint(gm, node, tag, region=region_id if tag is None else None):
            del regions[node]
            reason = ("handed to the recompute plan (memory_budget): a candidate segment of its own" if tag is None
                      else "compiled inline, recomputed in the compiled backward (as written); Python side effects "
                      "in it run once, in forward")
            state.eager_regions.append(EagerRegion("checkpoint", region.location, region.code, reason))


_CHECKPOINT_IDS = itertools.count(1)


def compile_graph(state, model: torch.nn.Module, gm: fx.GraphModule, example_inputs: list):
    """Lower, rewrite, plan and compile one graph (free of eager regions); record it in ``state``.
    Returns the callable that runs it (and re-plans a memory budget at its first calls)."""
    t0 = time.perf_counter()
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in example_inputs
              if not isinstance(t, torch.nn.Parameter)]
    try:
        captured = lower_to_aten(gm, example_inputs, {id(b) for b in model.buffers()},
                                 sizes_seen=_sizes_seen(state, shapes))
    except Exception as e:  # capture failure: dynamo's graph unchanged, as torch.compile runs it, not a failed step
        return _unlowered(state, gm, example_inputs, e)
    before_code = captured.gm.code
    before_ops = op_counts(captured.gm)
    before_launches = kernel_launches(captured.gm)
    # byte counts of a graph with symbolic sizes would be formulas: not analyzed (nor planned)
    analyze = state.analyze and not captured.dynamic
    # a graph with data-dependent sizes (a loop over experts) is slow to run on fake tensors and its
    # byte counts would be bounds: the replacement (static sizes, once the loop is rewritten) is analyzed
    unbacked = analyze and data_dependent(captured.gm, "val")
    before_gm = clone_graph_module(captured.gm) if analyze and not unbacked else None   # rewriting edits it
    before_nx = to_networkx(captured.gm)
    use_inductor = _uses_inductor(state, example_inputs)
    patterns, left, priced = _patterns_for(state, gm, use_inductor)
    static_only = sorted(p.name for p in patterns if not getattr(p, "dynamic_shapes", False)) \
        if captured.dynamic else []
    ctx = run_patterns(captured, [p for p in patterns if p.name not in static_only], state.skip, use_inductor,
                       example_inputs, budget=state.memory_budget is not None, priced=priced)
    # the planner's fake-tensor liveness run serves the report too; without a budget the report counts later
    by_node = saved_bytes_by_node(ctx.gm, captured.requires_grad) \
        if state.memory_budget is not None and not captured.dynamic else None
    analysis = DeferredSavedBytes(before_gm, by_node if by_node is not None else clone_graph_module(ctx.gm),
                                  captured.requires_grad, ctx.matches) if analyze else None
    plan = base = None
    if state.memory_budget is not None:
        if by_node is None:
            log.warning("opsmath: graph %d could not be analyzed on fake tensors; no recompute planned "
                        "for memory_budget=%r", len(state.graphs), state.memory_budget)
        else:
            # the plan may be made again after the first steps, on a fresh copy of the unplanned graph
            base = clone_graph_module(ctx.gm)
            plan, by_node = plan_graph(state, model, gm, ctx.gm, by_node, example_inputs, use_inductor)
    record = GraphRecord(
        index=len(state.graphs), training=model.training, input_shapes=shapes,
        before_code=before_code, after_code=ctx.gm.code, before_ops=before_ops, after_ops=op_counts(ctx.gm),
        matches=ctx.matches, declines=ctx.declines,
        capture_seconds=time.perf_counter() - t0, launches=(before_launches, kernel_launches(ctx.gm)),
        analysis=analysis, graph=ctx.gm, before_nx=before_nx, plan=plan,
        left_to_inductor=sorted(p.name for p in state.patterns if p.name in left),
        dynamic=captured.dynamic, static_only=static_only,
        left_on_gpu=_left_on_gpu(state, use_inductor, ctx.matches))
    record.source = gm
    state.graphs.append(record)
    fn = _finish(state, record, ctx.gm, example_inputs, use_inductor, graph_break=True)
    record.capture_seconds = time.perf_counter() - t0
    return guarded(runner(state, record, fn, base, by_node, model, use_inductor, _finish),
                   captured.buffer_guard(example_inputs),
                   lambda args, names: after_change(state, record.index, names, gm.forward, None if captured.dynamic
                                                    else lambda: compile_graph(state, model, gm, args)))


def _unlowered(state, gm: fx.GraphModule, example_inputs: list, error: Exception):
    """A graph that could not be lowered: compiled by Inductor as ``torch.compile`` would (no rewrites)
    where the graph goes to Inductor, else (or if that fails too) run as dynamo traced it; reported."""
    msg = f"graph {len(state.graphs)}: lowering to ATen failed ({type(error).__name__}: {error})"
    if _uses_inductor(state, example_inputs):
        try:
            fn = compile_fx(gm, example_inputs)
            state.fallback_errors.append(f"{msg}; compiled by Inductor without rewrites, as torch.compile does")
            log.warning("opsmath: %s", state.fallback_errors[-1])
            return fn
        except Exception as e2:  # noqa: BLE001 (reported; the graph still runs)
            msg += f"; Inductor failed on it too ({type(e2).__name__}: {str(e2)[:200]})"
    state.fallback_errors.append(f"{msg}; running it unoptimized")
    log.warning("opsmath: %s", state.fallback_errors[-1])
    return gm.forward


def piece_rewrite(state, use_inductor: bool):
    """``(piece, captured) -> rewritten graph``: a block's piece lowered on its example values, rewritten
    as its capture will be (no real inputs: rules that add graph inputs do not), for its floor's estimate
    (``budgets.reserve_floors``; priced families left out, as by default)."""
    def rewrite(piece, captured):
        patterns, _, priced = _patterns_for(state, piece, use_inductor)
        return run_patterns(captured, [p for p in patterns if p.name not in priced], state.skip, use_inductor,
                            budget=True).gm
    return rewrite


def _patterns_for(state, gm: fx.GraphModule, use_inductor: bool) -> tuple[list, set, frozenset]:
    """The families to run on ``gm``, those left to Inductor, and those priced per occurrence instead of
    left (``OPSMATH_PRICE=1``, ``rewrite/price.py``). None where autocast is entered for part of the graph
    (``capture/autocast.py``): the rules could not see its casts."""
    patterns, left = state.patterns, set()
    if autocast_inside(gm):
        patterns = []
        state.fallback_errors.append(f"graph {len(state.graphs)}: autocast is entered inside the captured code "
                                     "for part of it; the graph is left unrewritten (autocast around the call, "
                                     "or around the whole forward, is rewritten)")
    if use_inductor and state.default_patterns:
        left = _left_to_inductor(state)
        if price.enabled():
            return patterns, set(), frozenset(left)
        patterns = [p for p in patterns if p.name not in left]
    return patterns, left, frozenset()


def _sizes_seen(state, shapes: list) -> bool:
    """Whether an earlier graph was captured for inputs of these tensor sizes (symbolic sizes dynamo passes
    as extra int inputs left out): a recapture then comes from another change than the sizes."""
    tensors = [s for s in shapes if isinstance(s, tuple)]
    return any([s for s in r.input_shapes if isinstance(s, tuple)] == tensors for r in state.graphs)


def _finish(state, record, gm, example_inputs, use_inductor, graph_break: bool = False):
    """``ladder.finish`` with this module's ``compile_fx`` (looked up per call: tests replace it)."""
    return ladder.finish(state, record, gm, example_inputs, use_inductor, compile_fx, graph_break)
