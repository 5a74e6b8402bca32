"""``"selective-tensors"`` runs (``selective.finer``): the recompute plan frees a saved tensor at a time,
GEMM outputs among them, where that costs less per byte than a whole recompute. Each candidate must free
exactly what it counts under Inductor's partition, keep every gradient within the tolerance rule, and never
be combined with a step that recomputes a value it assumes kept."""
import shutil

import pytest
import torch

import opsmath
from opsmath.memory import analysis
from opsmath.memory.plan import clone_graph_module
from opsmath.memory.plan_choice import choose
from opsmath.memory.plan_emit import tag_recompute
from opsmath.memory.plan_solve import Step, conflicts, credited
from opsmath.memory.segments import Segment, forward_order, runs_of, segments_of
from opsmath.memory.selective import finer, held_inputs, saved_index, saved_storages, is_compute
from test_weight_casts import captured, compiled_grads, shares_capture, untagged_grads
from tolerance import assert_rule

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                               reason="Inductor on CPU needs a C++ compiler")


@needs_cxx
@shares_capture
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_each_candidate_frees_what_it_counts_within_the_tolerance_rule(device):
    """On an autocast LM (fp32 weights, LLaMA MLP blocks) every nested candidate of every block's run:
    the partition of the tagged graph saves the unplanned bytes less the candidate's saving (GEMM
    outputs and their weights' copies among what it frees); the largest one recomputes a GEMM, and its
    gradients hold the tolerance rule against the untagged step's, both measured against fp32."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _, optimized, found = captured(device)   # offload off: on CUDA it is a choice too
    saved, inputs = found["saved"], found["inputs"]
    graph = opsmath.report(optimized).graphs[0].graph
    order = forward_order(graph)
    index = saved_index(saved.pairs, True, saved.casts, saved.copies)
    kept = saved_storages(order, index)
    runs = runs_of(graph, segments_of(graph, saved))
    checked = 0
    for (i, j), run in sorted(runs.items()):
        if j != i:
            continue
        for cand in finer(order, run, index, kept):
            gm = clone_graph_module(graph)
            tag_recompute(gm, [cand], [], [0])
            with torch.autocast(device, dtype=torch.bfloat16):
                tagged = analysis.partitioned_saved_bytes(gm, inputs)
            freed = sum(saved.values()) - sum(tagged.values())
            # exact on CPU; on CUDA a recomputed value the candidate counts as kept in its stead can be
            # found saved anyway (the safe side): never less freed than counted, never more than recomputed
            assert (freed == cand.saving) if device == "cpu" else cand.saving <= freed <= cand.saved, \
                (i, sorted(cand.only))
            checked += 1
    assert checked >= 4
    # the most a block's run frees: its GEMM outputs are recomputed, and the gradients do not change
    best = max((c for (i, j), run in runs.items() if i == j for c in finer(order, run, index, kept)),
               key=lambda c: c.saving)
    by_name = {n.name: n for n in order}
    assert any(is_compute(by_name[n].target) for n in best.only) and best.casts > 0
    gm = clone_graph_module(graph)
    tag_recompute(gm, [best], [], [0])
    # a GEMM recomputed inside Inductor's backward graph rounds its bf16 output apart from the forward's
    # (as a whole recompute does): the tolerance rule against the step in fp32 (op by op)
    ref = compiled_grads(graph, inputs, autocast=False, compiled=False)
    for k, (a, b) in enumerate(zip(compiled_grads(gm, inputs), untagged_grads(device), strict=True)):
        assert_rule(a, b, ref[k], name=f"parameter {k}")


def test_a_step_is_dropped_where_another_recomputes_what_it_reads():
    """Segment 1 has two candidates: one (frees 80, 1 s) reads a value made in segment 0 (``reads``),
    assumed kept, the other (frees 70, 3 s) reads nothing from before; segment 0's only candidate
    recomputes that value. At 150 bytes the first two must free most of theirs, and the cheapest choice
    is the conflicting pair (``conflicts`` names it): ``choose`` returns the other."""
    segs = [Segment(0, 2, 100, 10, 10.0), Segment(3, 5, 100, 10, 10.0), Segment(6, 8, 100, 10, 10.0)]
    runs = {(i, i): sg for i, sg in enumerate(segs)}
    reader = Segment(3, 5, 80, 0, 1.0, only=frozenset({"b"}), reads=frozenset({(1, "a")}))
    other = Segment(3, 5, 70, 0, 3.0, only=frozenset({"c"}))
    sel = {(0, 0, "selective-free"): Segment(0, 2, 80, 0, 1.0, only=frozenset({"a"})),
           (1, 1, "selective-tensors"): [reader, other],
           (2, 2, "selective-free"): Segment(6, 8, 90, 0, 1.0, only=frozenset({"d"}))}
    first = Step(0, 0, "selective-free", 80, 1.0, 80, frozenset({"a"}))
    reads = Step(1, 1, "selective-tensors", 80, 1.0, 80, frozenset({"b"}), frozenset({(1, "a")}))
    assert conflicts(segs, [first, reads]) == [reads]
    assert conflicts(segs, [Step(0, 0, "casts", 5, 0.1, 5), reads]) == []
    got, kept, _, cost = choose(segs, runs, 0, "bytes", 150, sel=sel)
    assert [(st.i, st.saving) for st in got] == [(0, 80), (1, 70)]
    assert cost == 4.0 and kept == 150 and not conflicts(segs, got)


@needs_cxx
@shares_capture
def test_a_whole_recompute_frees_its_inputs_count_where_they_are_saved_anyway():
    """A whole recompute keeps its inputs for the recompute; a block's residual is saved anyway for the norm
    that reads it, counted at its producer already. ``held_inputs`` takes those out of the run's inputs: the
    partition of the run tagged alone frees exactly the credited saving (CPU), more than the run as counted."""
    _, optimized, found = captured()
    saved, inputs = found["saved"], found["inputs"]
    graph = opsmath.report(optimized).graphs[0].graph
    order = forward_order(graph)
    index = saved_index(saved.pairs, True, saved.casts, saved.copies)
    runs = runs_of(graph, segments_of(graph, saved))
    held = held_inputs(order, runs, saved_storages(order, index))
    checked = 0
    for (i, j), h in sorted(held.items()):
        if j - i > 2 or h.start == 0:
            continue
        assert h.saving > runs[(i, j)].saving and h.reads
        gm = clone_graph_module(graph)
        tag_recompute(gm, [h], [0])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tagged = analysis.partitioned_saved_bytes(gm, inputs)
        assert sum(saved.values()) - sum(tagged.values()) == h.saving, (i, j)
        checked += 1
    assert checked >= 3


def test_a_recompute_is_credited_only_where_no_other_step_recomputes_what_it_reads():
    """Run 2..3 keeps 10 bytes of inputs made in segment 0 (``reads``): credited with them beside a kept
    segment 0 or one whose weight copies alone recompute, not beside segment 0 recomputed."""
    segs = [Segment(0, 2, 100, 0, 1.0), Segment(3, 5, 100, 10, 1.0), Segment(6, 8, 100, 10, 1.0),
            Segment(9, 11, 100, 10, 1.0)]
    run = Step(2, 3, "recompute", 190, 2.0, 200)
    held = {(2, 3): Segment(6, 11, 200, 0, 2.0, reads=frozenset({(1, "a")}))}
    assert credited(segs, [run], held)[0].saving == 200
    assert credited(segs, [Step(0, 0, "casts", 5, 0.1, 5), run], held)[1].saving == 200
    assert credited(segs, [Step(0, 0, "recompute", 100, 1.0, 100), run], held)[1].saving == 190
    # six segments of 100 bytes, run i..j's inputs 10 (none for the first); each run from segment 2 on
    # reads its inputs from segment 0, kept. At 500 bytes (kept and a recompute's transient) the runs as
    # counted need 2..3 (190 bytes freed, 2 s); credited, segment 2 alone frees 100 for 1 s
    segs = [Segment(3 * k, 3 * k + 2, 100, 0 if k == 0 else 10, 5.0 if k < 2 else 1.0) for k in range(6)]
    runs = {(i, j): Segment(segs[i].start, segs[j].end, 100 * (j - i + 1), segs[i].inputs,
                            sum(sg.cost for sg in segs[i:j + 1])) for i in range(6) for j in range(i, 6)}
    held = {ij: Segment(r.start, r.end, r.saved, 0, r.cost, reads=frozenset({(1, "a")}))
            for ij, r in runs.items() if ij[0] >= 2}
    got, kept, _, cost = choose(segs, runs, 0, "bytes", 500)
    assert [(st.i, st.j, st.saving) for st in got] == [(2, 3, 190)] and cost == 2.0
    got, kept, _, cost = choose(segs, runs, 0, "bytes", 500, held=held)
    assert [(st.i, st.j, st.saving) for st in got] == [(2, 2, 100)] and cost == 1.0 and kept == 500
