"""The fallback ladder: what runs a captured graph when Inductor fails on it.

A compile that fails must not cost the user more than ``torch.compile`` would:

1. Inductor on the rewritten graph (twice where its scalar pass asks to start again: a float it cannot make a
   tensor, specialized by then);
2. if it raises, Inductor on dynamo's graph as captured (what ``torch.compile`` runs for the same frame):
   the graph's rewrites and plan are then reported as declined with the failure;
3. if that raises too with an error dynamo itself answers with a graph break (a data-dependent output, an
   operator fake tensors cannot run: ``torch._dynamo.exc.exceptions_allowed_to_be_fallback``), that error
   goes back to dynamo, which breaks the graph there and runs the frame as ``torch.compile`` would
   (``graph_break``, and only while dynamo is compiling: a piece's first call, a recapture or a re-plan
   at run time has no dynamo to answer);
4. else the rewritten graph runs op by op under autograd (``torch.compile`` would raise).

Each rung taken is a report line (``state.fallback_errors``).
"""
from __future__ import annotations

import logging
import time

from opsmath.rewrite.match import Decline
from opsmath.runtime import fp8_weights, wgrad

log = logging.getLogger("opsmath")


def finish(state, record, gm, example_inputs, use_inductor: bool, compile_fx, graph_break: bool = False):
    """The callable that runs ``gm`` on the user's inputs: Inductor's compiled graph (``compile_fx``), or
    ``gm`` itself (op by op), handed the FP8 weight copies ``gm`` takes (``fp8_weights``); down the ladder
    where Inductor fails."""
    if not use_inductor:
        return fp8_weights.with_copies(state.weight_casts, gm, gm)
    for attempt in range(2):   # a second time only after a scalar's restart signal (``_restarts``)
        try:
            t1, passes, rewritten = time.perf_counter(), wgrad.PASSES[0], wgrad.REWRITTEN[0]
            fn = compile_fx(gm, fp8_weights.example_inputs(state.weight_casts, gm, example_inputs),
                            cuda_graphs=state.cuda_graphs)
            record.inductor, record.inductor_seconds = True, record.inductor_seconds + time.perf_counter() - t1
            record.fp32_wgrad = wgrad.REWRITTEN[0] - rewritten if wgrad.PASSES[0] > passes else None
            record.cuda_graphs = state.cuda_graphs
            return fp8_weights.with_copies(state.weight_casts, gm, fn)
        except Exception as e:
            failure = f"Inductor failed on the rewritten graph ({type(e).__name__}: {str(e)[:300]})"
            log.info("opsmath: graph %d: %s", record.index, failure, exc_info=True)
            if attempt or not _restarts(e):
                break
    if record.source is not None:
        try:
            fn = compile_fx(record.source, example_inputs, cuda_graphs=state.cuda_graphs)
        except Exception as e:
            log.info("opsmath: graph %d: Inductor failed on dynamo's graph too", record.index, exc_info=True)
            failure += f"; on dynamo's graph too ({type(e).__name__}: {str(e)[:200]})"
            if graph_break and breaks_graph(e) and _dynamo_compiling():
                not_applied(record, failure)
                if record in state.graphs:   # dynamo captures the frame again, as other graphs
                    state.graphs.remove(record)
                _note(state, f"graph {record.index}: {failure}; handed back to dynamo, which breaks the graph "
                      "there as torch.compile does (the graphs around the break are captured again)")
                raise
        else:
            not_applied(record, failure)
            _note(state, f"graph {record.index}: {failure}; compiled dynamo's graph as torch.compile does, "
                  "without rewrites")
            record.inductor, record.cuda_graphs = True, state.cuda_graphs
            return fn
    _note(state, f"graph {record.index}: {failure}; running the rewritten graph op by op")
    return fp8_weights.with_copies(state.weight_casts, gm, gm)


def _restarts(e: Exception) -> bool:
    """Whether ``e`` is Inductor's scalar pass asking to start again (``TensorifyScalarRestartAnalysis``: a
    float it cannot turn into a tensor, now specialized in the shape environment), which a second compile
    of the same graph passes."""
    from torch._dynamo import exc
    return isinstance(e, getattr(exc, "TensorifyScalarRestartAnalysis", ()))


def breaks_graph(e: Exception) -> bool:
    """Whether dynamo answers ``e`` from a backend with a graph break (not an error)."""
    try:
        from torch._dynamo.exc import exceptions_allowed_to_be_fallback
    except ImportError:
        return False
    return isinstance(e, exceptions_allowed_to_be_fallback)


def _dynamo_compiling() -> bool:
    """Whether dynamo is compiling a frame now (a piece's first call, a recapture after a buffer changed,
    run at the user's call, have no dynamo to hand an error back to)."""
    from torch._guards import TracingContext
    return TracingContext.try_get() is not None


def not_applied(record, failure: str) -> None:
    """``record``'s rewrites and plan did not reach the compiled graph: each match becomes a decline."""
    record.declines = record.declines + [Decline(m.pattern, m.location, m.code, m.anchor, failure)
                                         for m in record.matches]
    record.matches, record.plan, record.after_code = [], None, record.before_code


def _note(state, msg: str) -> None:
    log.warning("opsmath: %s", msg)
    state.fallback_errors.append(msg)
