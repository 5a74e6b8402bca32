"""Offload, the plan's third choice (``opsmath_compiler/offload.py``): the solver weighs the host copies
against recompute, reaches budgets below the recompute floor, and under Inductor the offloaded tensors
go through its partitioner's offload and training equals eager. On CPU the "host" is the same memory:
these tests check the choice, the marks and the exactness; the GPU rows in BENCHMARKS.md the speed."""
import shutil

import pytest
import torch

import opsmath
from opsmath import offload
from opsmath.plan import InfeasibleBudget, choose, merged
from opsmath.segments import Segment
from test_inductor import pair, step_equals_eager

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                               reason="Inductor on CPU needs a C++ compiler")


def _chain(cost):
    """Four segments saving 100 bytes each, keeping a 20-byte input when recomputed, ``cost`` s each."""
    segs = [Segment(3 * k, 3 * k + 2, 100, 20, cost) for k in range(4)]
    runs = {(i, j): Segment(segs[i].start, segs[j].end, 100 * (j - i + 1), 20, cost * (j - i + 1))
            for i in range(4) for j in range(i, 4)}
    return segs, runs


def test_solver_offloads_only_where_copies_beat_recompute():
    """Budget 0.75 of 400 bytes (kept + the largest segment live again in backward <= 300). With a link
    at which copying 100 bytes out and back (2e-6 s) is cheaper than recomputing (1 s), segments are
    offloaded; at a link where the copy costs 200 s they are recomputed; without a link offload is never
    a choice."""
    segs, runs = _chain(cost=1.0)
    for link, kind in ((1e8, "offload"), (1.0, "recompute"), (None, "recompute")):
        picked, kept, trans, cost = choose(segs, runs, 0, "fraction", 0.75, link=link)
        assert {st.kind for st in picked} == {kind} and kept + trans <= 300
        out, chosen, offloaded = merged(segs, runs, picked)
        assert (offloaded != {}) == (kind == "offload") and (chosen != []) == (kind == "recompute")


def test_offload_reaches_below_the_recompute_floor():
    """Recompute alone peaks at 0.4 of the activations at best (three segments recomputed, the last
    kept: 60 + 100 bytes at the start of backward, the floor the error names); with offload 0.26 is
    feasible: three segments go to the host and come back one at a time, the last stays (100 bytes),
    and the InfeasibleBudget floor drops to one segment, 0.25."""
    segs, runs = _chain(cost=1.0)
    with pytest.raises(InfeasibleBudget, match="fraction 0.40"):
        choose(segs, runs, 0, "fraction", 0.26)
    picked, kept, trans, _ = choose(segs, runs, 0, "fraction", 0.26, link=1e6)
    assert kept + trans == 100 and {st.kind for st in picked} <= {"offload", "recompute+offload"}
    with pytest.raises(InfeasibleBudget, match="fraction 0.250"):
        choose(segs, runs, 0, "fraction", 0.2, link=1e6)


@needs_cxx
def test_inductor_offload_trains_exactly_as_eager(monkeypatch):
    """A budget below GPT's recompute floor, with a (pretended) host link: the plan offloads, the nodes
    are marked, Inductor compiles with its offload on, and loss and every gradient equal eager."""
    monkeypatch.setattr(offload, "link_for", lambda inputs, how: 5e9 if how == "tag" else None)
    ref, model, batch = pair(dropout=0.0)
    probe = opsmath.optimize(pair(dropout=0.0)[1], memory_budget=0.3, inductor=True)
    with pytest.raises(InfeasibleBudget):
        monkeypatch.setattr(offload, "link_for", lambda inputs, how: None)
        probe(*batch)
    torch._dynamo.reset()
    monkeypatch.setattr(offload, "link_for", lambda inputs, how: 5e9 if how == "tag" else None)
    model = opsmath.optimize(model, memory_budget=0.3, inductor=True)
    step_equals_eager(model, ref, batch)
    plan = opsmath.report(model).graphs[0].plan
    assert plan.offloaded and plan.offloaded_bytes > 0 and plan.kept + plan.transient <= 0.3 * plan.unconstrained
    assert offload.has_offload(opsmath.report(model).graphs[0].graph)
    assert "host memory" in opsmath.report(model).render(width=200)
