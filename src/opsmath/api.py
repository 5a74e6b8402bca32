"""``opsmath.optimize``: the one line users add.

``optimize(model)`` compiles the module *in place* with a dynamo backend (as ``nn.Module.compile`` does), so it
returns the same object: same Parameters, same ``state_dict()`` keys, any optimizer keeps working. The
first call captures with the real inputs; dynamo's guards re-capture on train/eval switches, new input
shapes (a size that changes between calls becomes symbolic, as under ``torch.compile``; under a memory
budget every shape gets its own, exactly planned graph), autocast changes and graph breaks, each variant going through the same pipeline::

    dynamo graph -> pre-dispatch ATen (capture) -> patterns (match + replace) -> GraphModule (emit)

(``backend.py``). Constructs with their own autograd semantics (a user ``autograd.Function``, a tensor
hook registered in ``forward``) are cut out of the graph first and run as dynamo traced them; the
report lists them (``regions.py``).

The fused ops are ``torch.library`` custom ops with their own backward. On CUDA the emitted GraphModule
is then handed to Inductor (``compile_fx``, what ``torch.compile`` runs): the custom ops stay opaque
extern kernels and Inductor fuses everything around them, so the rewrites add to what ``torch.compile``
does instead of competing with it. On CPU (or with ``inductor=False``) it runs op by op under
autograd. ``report(model)`` shows what happened to every captured graph.
"""
from __future__ import annotations

import contextlib
import logging
import types
from dataclasses import dataclass, field
from typing import Optional

import torch

import opsmath.kernels  # noqa: F401  (registers the opsmath:: custom ops)
from opsmath.patterns import ALL as ALL_PATTERNS, NAMES as PATTERN_NAMES
from opsmath.patterns.experts import tracing_settings
from opsmath.patterns.fp8_linear import WEIGHT_CACHE, with_scaling

from opsmath.runtime.backend import INDUCTOR_FUSES_BETTER, GraphRecord, make_backend  # noqa: F401  (re-exported)
from opsmath.runtime.cudagraphs import CUDA_GRAPHS_NOTE, guard_for
from opsmath.runtime.fp8_weights import WeightCasts
from opsmath.memory.plan import InfeasibleBudget, check_step_share, parse_budget
from opsmath.memory.replan import rebalance
from opsmath.capture.interrupts import interrupts_deferred
from opsmath.capture import graph_breaks
from opsmath.capture.regions import CHECKPOINT_SIDE_EFFECTS, EagerRegion

log = logging.getLogger("opsmath")


# dynamo's recompile limit for opsmath's frames: each train/eval, grad-mode, autocast or static-size
# variant is a recompile
RECOMPILE_LIMIT = 64
SKIP_ONLY = (WEIGHT_CACHE,)   # skip= names that are not pattern families


@dataclass
class OptimizeState:
    """Attached to an optimized module as ``module._opsmath``; ``report()`` reads it."""
    model_name: str
    patterns: list
    skip: set = field(default_factory=set)
    memory_budget: Optional[object] = None
    graphs: list[GraphRecord] = field(default_factory=list)
    fallback_errors: list[str] = field(default_factory=list)
    analyze: bool = True
    inductor: Optional[bool] = None         # None: Inductor when the graph's tensors are on CUDA
    default_patterns: bool = True           # patterns= not given: Inductor graphs skip INDUCTOR_FUSES_BETTER
    cuda_graphs: bool = False               # Inductor replays each compiled graph as a CUDA graph
    eager_regions: list[EagerRegion] = field(default_factory=list)   # left to eager (regions.py), why
    graph_runs: int = 0                     # calls of opsmath's graphs, all together
    step_start: int = 0                     # graph_runs when the current model call began
    rebalanced: bool = False                # the step's graphs are planned again at their next call
    forward_peak: Optional[int] = None      # CUDA peak up to the current backward's start (replan.py)
    forward_gap: int = 0                    # reserved beyond that peak, in the same window (replan.py)
    unoptimized_calls: int = 0              # model calls that ran none of them (e.g. past the recompile limit)
    trained_inputs: set = field(default_factory=set)   # input signatures of calls with gradients on
    eager_inference_calls: int = 0          # no-grad calls at other inputs, run eagerly (_inference_left_eager)
    notes: list[str] = field(default_factory=list)   # what rules changed on the module (Rule.prepare)
    cuda_graph_skips: list[str] = field(default_factory=list)   # Inductor's reasons for not replaying
    weight_casts: WeightCasts = field(default_factory=WeightCasts)   # FP8 weight copies (fp8_weights.py)

    def __reduce__(self):
        """Pickled or deep-copied with its module, the state becomes None: like ``Module.compile()``'s
        compiled call (which ``Module.__getstate__`` drops), the copy is the plain module, run eagerly
        (``torch.save(model)``, an EMA copy); optimize the copy to compile it again."""
        return _no_state, ()


def _no_state():
    return None


def optimize(model: torch.nn.Module, memory_budget=None, *, patterns=None, skip=None, analyze=True,
             inductor=None, cuda_graphs=False, fp8=False, **options) -> torch.nn.Module:
    """Rewrite ``model``'s fusable subgraphs (``opsmath.patterns.NAMES``: attention, dropout-add-norm, the
    LM-head loss, cross-entropy, SwiGLU, bias-GELU, scaled softmax, experts loops) into fused kernels,
    lazily, at the first call; on CUDA those Inductor does better are left to it (``INDUCTOR_FUSES_BETTER``).

    Args:
        model: any ``nn.Module``; it is compiled in place and returned (same object).
        memory_budget: bytes (an int, or an integral float such as ``6e9``) or a size (``"6GB"``,
            ``"6GiB"``, ``"512MiB"``) bounding the step's predicted peak (resident weights, grads,
            optimizer state and inputs included), or a fraction in (0, 1] (``0.5``, ``"0.5"``,
            ``"50%"``) of the unconstrained activation memory. Recompute is planned per captured
            graph (``plan.py``); an infeasible budget raises ``InfeasibleBudget`` naming the smallest
            feasible one. A fraction keeps that share of the activations (``1.0``: no recompute).
            A byte budget's plan is checked at a graph's second call against what step 1 measured
            (resident bytes, CUDA peak) and made again if needed, at its third call tightened once
            more if still over (``replan.py``); to measure those steps, a budget resets
            ``torch.cuda`` peak memory statistics at the graph's first and second calls.
        patterns: names of pattern families to apply (default: all, see ``opsmath.patterns.NAMES``,
            less ``INDUCTOR_FUSES_BETTER`` when Inductor compiles the graph; given explicitly, exactly these).
        skip: families (``"attention"``), occurrences (``"attention@softmax_3"``, as the report names them)
            or a family inside modules, by name or glob (``"fp8_linear@lm_head"``), left alone.
        analyze: predict saved activation bytes before/after for the report (one extra fake-tensor
            run of each captured graph at capture time).
        inductor: compile the rewritten graph with Inductor (fusing everything the patterns left
            alone; the opsmath ops stay opaque). ``None`` (default): on when the inputs are on CUDA.
            Under a memory budget the plan is then passed as recompute tags to Inductor's partitioner
            instead of ``checkpoint`` calls.
        cuda_graphs: let Inductor replay each compiled forward and backward as a CUDA graph (its
            CUDA-graph trees, what ``torch.compile(mode="reduce-overhead")`` uses), which removes the
            per-kernel launch cost of a step. opsmath's kernels read their dropout seeds from device
            memory, so each replay draws fresh masks. Ordinary loops need no change (``cudagraphs.py``),
            but a large output (logits) kept past the next step's forward must be cloned, as under
            ``reduce-overhead``. CPU graphs run without. Needs the Inductor path; an outer
            ``torch.compile(..., mode="reduce-overhead")`` does not reach opsmath's graphs: ask here.
        fp8: ``True`` or ``"tensorwise"``: bf16 linear layers whose GEMMs gain (``src/opsmath/patterns/fp8_linear.py``) run
            forward and backward on FP8 tensor cores, dynamic tensorwise scaling (e4m3 operands, e5m2 gradients);
            ``"cached"``: the same, each weight cast once per optimizer step (``fp8_weights.py``); ``"rowwise"``: a
            scale per operand row, e4m3 throughout. The report lists every linear as FP8 or not, with the reason.
            Numerics change beyond the tolerance rule (judge by loss curves). Needs sm_89+ on CUDA (CPU: reference).

    Returns:
        ``model``, whose next call captures and rewrites; ``opsmath.report(model)`` shows the result.
    """
    if options:
        raise TypeError(f"optimize() got unknown options {sorted(options)}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"optimize() takes an nn.Module, got {type(model).__name__}")
    if cuda_graphs and inductor is False:
        raise ValueError("optimize(cuda_graphs=True) replays Inductor's compiled graphs; it needs the Inductor "
                         "path, not inductor=False")
    state = new_state(type(model).__name__, memory_budget, patterns, skip, analyze, inductor, cuda_graphs, fp8)
    graph_breaks.watch()   # the report names each graph break's line
    graph_breaks.hf_loss_resolved(model)   # HF's loss_function logs on each access: no graph break
    model._opsmath = state
    state.notes = [note for p in state.patterns if p.name not in state.skip for note in p.prepare(model)]
    state.notes += [CUDA_GRAPHS_NOTE] if cuda_graphs else []
    # dynamo skips a top-level frame that lives in torch/ (``nn.Sequential``, ``nn.TransformerEncoderLayer``
    # called directly): it compiles this frame instead and inlines the module's ``_call_impl`` from here
    def opsmath_frame(*args, **kwargs):
        return model._call_impl(*args, **kwargs)
    # sizes that change between calls (sequence lengths) become symbolic after the second one, as under
    # torch.compile: one graph serves them all. A memory budget plans exact sizes: every shape its own.
    compiled = torch.compile(opsmath_frame, backend=make_backend(state, model),
                             dynamic=False if memory_budget is not None else None)

    _install(model, _caller(state, model, compiled, inductor))
    return model


def new_state(name: str, memory_budget, patterns, skip, analyze, inductor, cuda_graphs, fp8) -> OptimizeState:
    """The state of one optimized module (or one ``torch.compile(..., backend="opsmath")``) from
    ``optimize``'s options, checked: a bad option is an error now, not at the first call."""
    patterns, skip = _names(patterns, "patterns"), _names(skip, "skip") or []
    chosen = _chosen(patterns, fp8)
    unknown = sorted({s.split("@")[0] for s in [*(patterns or []), *skip]} - {*PATTERN_NAMES, *SKIP_ONLY})
    if unknown:
        raise ValueError(f"unknown pattern families {unknown}; known: {PATTERN_NAMES} (skip also takes one "
                         "occurrence as 'family@node', the node named in the report)")
    if memory_budget is not None:
        parse_budget(memory_budget)
    return OptimizeState(model_name=name, patterns=chosen, skip=set(skip), memory_budget=memory_budget,
                         analyze=analyze, inductor=inductor, default_patterns=patterns is None,
                         cuda_graphs=bool(cuda_graphs))


def _install(model: torch.nn.Module, call) -> None:
    """Make ``call`` the module's compiled call. Under an outer ``torch.compile(model)`` dynamo would trace
    through the in-place compile and hand the original graph to Inductor without opsmath's rewrites or its
    memory plan: the outer compile skips this frame instead (``disable``), and the frames below it go
    through opsmath (and Inductor) as usual. Dynamo calls a module's class ``forward`` directly (skipping
    the compiled call) for torch's own classes (``nn.Sequential`` under ``torch.compile``) and for every
    submodule of a compiled parent, where opsmath would silently not run: the instance gets its own
    ``forward`` (the class's, bound: same math, signature and ``__func__``; copies and pickles rebind it
    to themselves), which makes dynamo call the module. ``model.compile()`` keeps opsmath
    (``CompileKeepsOpsmath``)."""
    model._compiled_call_impl = torch._dynamo.disable(call, recursive=False)
    previous = model.__dict__.get("__getstate__")   # optimized before: what that call installed stays listed
    installed = ["_opsmath", "__getstate__"] + (previous.installed if isinstance(previous, PlainState) else [])
    if "forward" not in model.__dict__:   # one set on the instance already (accelerate's wrappers) stays
        model.forward = types.MethodType(type(model).forward, model)
        installed.append("forward")
    if type(model).compile is torch.nn.Module.compile:   # a class's own compile() means something else
        model.compile = CompileKeepsOpsmath(model)
        installed.append("compile")
    model.__getstate__ = PlainState(model, installed)


class PlainState:
    """The ``__getstate__`` of an optimized module: what pickles and copies (``torch.save``,
    ``copy.deepcopy``) carry is the plain module's state, without what ``optimize`` installed (its state,
    the bound ``forward``, ``compile``), as ``Module.__getstate__`` drops the compiled call. The copy runs
    eagerly, and a ``torch.load(..., weights_only=True)`` of it needs no opsmath global allowlisted."""

    def __init__(self, module: torch.nn.Module, installed: list):
        self.module, self.installed = module, installed

    def __call__(self) -> dict:
        state = torch.nn.Module.__getstate__(self.module)
        for name in self.installed:
            state.pop(name, None)
        return state


class CompileKeepsOpsmath:
    """``model.compile()`` on an optimized module. ``Module.compile`` replaces the module's compiled call,
    which is opsmath's: its rewrites and memory plan would silently stop. opsmath already compiles the
    module (Inductor on CUDA), so the call is ignored with a warning. On a copy or an unpickled module
    (plain modules, ``OptimizeState.__reduce__``) it is ``Module.compile``."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        if getattr(self.module, "_opsmath", None) is None:
            return torch.nn.Module.compile(self.module, *args, **kwargs)
        log.warning("opsmath: model.compile() on a module opsmath.optimize compiles already: ignored, so its "
                    "rewrites and memory plan stay (optimize's own options set Inductor and CUDA graphs)")

    def __reduce__(self):
        return CompileKeepsOpsmath, (self.module,)


def _chosen(patterns, fp8) -> list:
    """The rules ``optimize`` applies: all but the opt-in ones not asked for, or exactly ``patterns``."""
    if fp8 not in (False, True, "tensorwise", "rowwise", "cached"):
        raise ValueError(f"fp8={fp8!r}: use True or 'tensorwise' (a dynamic scale per tensor), 'cached' (tensorwise, "
                         "weights cast once per optimizer step) or 'rowwise' (per row); delayed scaling is not "
                         "implemented")
    rules = ALL_PATTERNS if fp8 not in ("rowwise", "cached") else \
        [with_scaling(p, "rowwise" if fp8 == "rowwise" else "tensorwise", fp8 == "cached")
         if p.name == "fp8_linear" else p for p in ALL_PATTERNS]
    if patterns is not None:
        return [p for p in rules if p.name in set(patterns)]
    enabled = {"fp8": bool(fp8)}
    return [p for p in rules if p.opt_in is None or enabled[p.opt_in]]


def _caller(state: OptimizeState, model: torch.nn.Module, compiled, inductor):
    """What the optimized module's ``__call__`` runs: dynamo's compiled frame, with opsmath's dynamo
    settings, bookkeeping for the report, and eager's own error for a call that cannot be traced."""
    experts = tracing_settings(model) \
        if any(p.name == "experts" for p in state.patterns) and "experts" not in state.skip else {}
    guard = guard_for(model, state)
    logs = graph_breaks.reordered_logs()

    def call(*args, **kwargs):
        # Run op by op under autograd, the rewritten graph fires DDP's per-parameter gradient hooks as
        # each gradient is produced; dynamo's DDP graph splitting (optimize_ddp) is then not needed and
        # would cut patterns at bucket boundaries: it is off for opsmath's frames. Under Inductor the
        # backward is one compiled graph, so the split stays (the user's setting) to keep the overlap.
        # Past dynamo's recompile limit (8 by default) a frame silently runs eager: opsmath's frames get
        # RECOMPILE_LIMIT, and a call that ran none of opsmath's graphs is counted for the report.
        # A module hook registered after capture must run (dynamo skips guarding on hooks by default,
        # so the graph would silently go on without it): hooks are guarded, a new one recaptures.
        if _inference_left_eager(state, args, kwargs):
            state.eager_inference_calls += 1
            return model._call_impl(*args, **kwargs)
        patches = dict(recompile_limit=max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit),
                       skip_nnmodule_hook_guards=False)
        patches.update(experts)   # a torch.where per expert traced (an unbacked size), not a graph break
        patches.update(CHECKPOINT_SIDE_EFFECTS)   # (capture/regions.py)
        patches.update(logs)      # HF's logger.warning_once after the graph, not a graph break
        if inductor is False or (inductor is None and not _on_cuda(model)):
            patches["optimize_ddp"] = False
        # the first capture (dynamo's tracing included) takes Ctrl-C at its end (capture/interrupts.py)
        with _dynamo_settings(patches), interrupts_deferred() if not state.graphs else contextlib.nullcontext():
            breaks, runs, captured = graph_breaks.counts(), state.graph_runs, len(state.graphs)
            state.step_start = runs
            try:
                if guard is None:
                    out = compiled(*args, **kwargs)
                else:
                    guard.before_call()    # CUDA-graph replay: what the loop reads later leaves the pool
                    out = guard.after_call(compiled(*args, **kwargs))
                ran = [r for r in state.graphs if r.last_run > runs]
                if state.memory_budget is not None and (len(state.graphs) > captured or state.rebalanced):
                    # a step that planned, or the next one, whose graphs took their plans for the whole step
                    state.rebalanced = len(state.graphs) > captured and rebalance(state, ran)
                    if not state.rebalanced:
                        check_step_share(state.memory_budget, ran)
                return out
            except torch._dynamo.exc.BackendCompilerFailed as e:
                if isinstance(getattr(e, "inner_exception", None), InfeasibleBudget):
                    raise e.inner_exception from None
                raise
            except torch._dynamo.exc.TorchRuntimeError as e:
                # an op failed on fake tensors while dynamo traced the call (nothing ran yet): most often
                # the user's own mistake (a shape, dtype or device), which eager reports in one line.
                # Run the call eagerly: it raises that error, or, if the failure was the tracer's, runs.
                # (outside this handler: eager's error then reads as eager's, not chained to dynamo's)
                state.fallback_errors.append(f"a call could not be traced and ran eagerly: {str(e).splitlines()[0]}")
            finally:
                if graph_breaks.counts() != breaks:
                    graph_breaks.note(breaks, state.eager_regions)
                if state.graph_runs == runs:
                    state.unoptimized_calls += 1
        return model._call_impl(*args, **kwargs)
    return call


def _inference_left_eager(state: OptimizeState, args: tuple, kwargs: dict) -> bool:
    """Whether this call runs eagerly: without gradients, at inputs no training call had, once the model
    has trained (``model.generate()`` or an evaluation at another size inside a training run). Capturing
    those would cost a capture per decoded length (20 tokens of a small LLaMA: 5.3 s against 0.13 s eager
    on CPU); an evaluation at the training batch's shapes is compiled, once. Without any training call
    (inference only) every call is compiled. Counted for the report."""
    sig = tuple(_sig(a) for a in args) + tuple((k, _sig(v)) for k, v in kwargs.items())
    if torch.is_grad_enabled():
        state.trained_inputs.add(sig)
        return False
    return bool(state.trained_inputs) and sig not in state.trained_inputs


def _sig(x):
    return tuple(x.shape) if isinstance(x, torch.Tensor) else x if isinstance(x, (int, bool, type(None))) \
        else type(x).__name__


@contextlib.contextmanager
def _dynamo_settings(patches: dict):
    """``torch._dynamo.config.patch`` for the settings that differ, without its per-call class: this runs
    on every call of an optimized model, where host time counts (a step can be host-bound)."""
    cfg = torch._dynamo.config
    current = {k: getattr(cfg, k) for k in patches}   # one read each: the config's getattr is not cheap
    changed = {k: old for k, old in current.items() if old != patches[k]}
    for k in changed:
        setattr(cfg, k, patches[k])
    try:
        yield
    finally:
        for k, v in changed.items():
            setattr(cfg, k, v)


def _names(value, what: str):
    """``patterns=`` / ``skip=`` as a list of names: one string is one name, None stays None."""
    if value is None or isinstance(value, str):
        return None if value is None else [value]
    try:
        names = list(value)
    except TypeError:
        raise TypeError(f"{what}= takes a name or a list of names, got {type(value).__name__}") from None
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what}= takes pattern names (strings), got {names!r}")
    return names


def _on_cuda(model: torch.nn.Module) -> bool:
    p = next(iter(model.parameters()), None)
    return p is not None and p.is_cuda


def state_of(model) -> OptimizeState:
    """The state of a module ``optimize`` returned, or of ``torch.compile(module, backend="opsmath")``."""
    st = getattr(model, "_opsmath", None)
    if st is None:
        st = _state_of_compiled(model)
    if st is None:
        raise ValueError("this module was not returned by opsmath.optimize() nor by torch.compile(..., "
                         "backend='opsmath') (a compiled module reports after its first call)")
    return st


def _state_of_compiled(compiled):
    """The state of ``torch.compile(module, backend="opsmath")``'s result, or of a module compiled in place
    with ``module.compile(backend="opsmath")`` (per-layer compilation, as torchtune does), or None."""
    from torch._dynamo.eval_frame import _TorchDynamoContext, innermost_backend
    for fn in (compiled, getattr(compiled, "_compiled_call_impl", None)):
        ctx = getattr(fn, "dynamo_ctx", None)
        # a compiled function keeps its dynamo context in its closure
        cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if _filled(c)]
        ctx = ctx or next((c for c in cells if isinstance(c, _TorchDynamoContext)), None)
        callback = getattr(ctx, "callback", None)
        state = getattr(innermost_backend(callback), "_opsmath_state", None) if callback is not None else None
        if state is not None:
            return state
    return None


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
