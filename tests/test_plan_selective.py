"""Selective recompute, the plan's finer choice: a segment keeps its GEMMs and fused GEMM ops and
recomputes only its cheap ops (norms, activations, dropout, casts, views). The candidate's bytes come
from the liveness analysis by producer; the plan takes it where it meets the budget more cheaply than
recomputing whole segments, and training equals eager on both emission paths (selective checkpoint
contexts op by op, MUST_SAVE / MUST_RECOMPUTE tags under Inductor)."""
import shutil

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import opsmath
from opsmath import examples
from opsmath.memory.analysis import saved_bytes_by_node
from opsmath.memory.plan_emit import policy
from opsmath.memory.segments import forward_order, runs_of, segments_of
from opsmath.memory.selective import saved_index, selective

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                               reason="Inductor on CPU needs a C++ compiler")


def _model():
    torch._dynamo.reset()
    torch.manual_seed(0)
    return examples.gpt(batch_size=4, seq_len=64, n_layer=4, dropout=0.1)


def _step(opt, model, batch, seed=1):
    torch.manual_seed(seed)
    loss = opt(*batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _planned_exactly(budget, inductor):
    """(plan, report) of the model trained one step under ``budget``; its loss and gradients checked
    equal to the same step without a plan (dropout on)."""
    model, batch = _model()
    ref = opsmath.optimize(model, inductor=inductor)
    loss0, grads0 = _step(ref, model, batch)
    model, batch = _model()
    opt = opsmath.optimize(model, memory_budget=budget, inductor=inductor)
    loss1, grads1 = _step(opt, model, batch)
    torch.testing.assert_close(loss0, loss1, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads0, grads1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    rep = opsmath.report(opt)
    return rep.graphs[0].plan, rep


def test_saved_bytes_by_producer_add_up():
    """Every saved storage has one saver and one producer: the pairs add up to the per-saver bytes."""
    model, batch = _model()
    opt = opsmath.optimize(model, memory_budget=1.0)
    opt(*batch).backward()
    gm = opsmath.report(opt).graphs[0].graph
    by = saved_bytes_by_node(gm, [True] * len(gm.graph.find_nodes(op="placeholder")))
    assert by is not None and sum(b for _, _, b in by.pairs) == sum(by.values()) > 0
    assert {saver for saver, _, _ in by.pairs} == set(by)


def test_policy_keeps_gemms_and_fused_gemm_ops():
    keep = policy("selective")
    assert keep(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert keep(None, torch.ops.opsmath.attention.default) == CheckpointPolicy.MUST_SAVE
    assert keep(None, torch.ops.aten.gelu.default) == CheckpointPolicy.PREFER_RECOMPUTE


def test_solver_takes_selective_where_gemms_are_dear():
    """Two segments saving 100 bytes, each recomputable whole (keeps 10, costs 10 s: its GEMMs) or
    selectively (frees 60, costs 1 s). A budget of 150 bytes takes the first segment's selective step
    (cost 1, 140 kept, 40 + 60 live in its backward) over a whole recompute (10); the second segment's
    would find the first's 100 bytes still held in its backward (200)."""
    from opsmath.memory.plan import choose, merged
    from opsmath.memory.segments import Segment
    segs = [Segment(0, 2, 100, 10, 10.0), Segment(3, 5, 100, 10, 10.0)]
    runs = {(0, 0): segs[0], (1, 1): segs[1], (0, 1): Segment(0, 5, 200, 10, 20.0)}
    sel = {(i, i, "selective"): Segment(s.start, s.end, 60, 0, 1.0) for i, s in enumerate(segs)}
    picked, kept, trans, cost = choose(segs, runs, 0, "bytes", 150, sel=sel)
    assert [(st.i, st.kind) for st in picked] == [(0, "selective")] and cost == 1.0 and kept == 140
    out, chosen, kinds = merged(segs, runs, picked)
    assert chosen == [] and kinds == {0: "selective"} and out[0].inputs == 40


@pytest.mark.parametrize("inductor", [False, pytest.param(True, marks=needs_cxx)])
def test_selective_plan_is_chosen_and_exact(inductor, monkeypatch):
    """With GEMMs made dear in the cost model (at these tiny sizes launches dominate it otherwise), the
    plan at 0.85 recomputes cheap ops only; loss and gradients equal no plan, dropout on."""
    from opsmath.memory import segments
    monkeypatch.setattr(segments, "_FLOP_RATE", 1e6)
    plan, rep = _planned_exactly(0.85, inductor)
    assert plan.selective and plan.kept + plan.transient <= 0.85 * plan.unconstrained, plan.to_dict()
    assert "recompute only their cheap ops" in rep.render(width=200)
    if not inductor:
        assert "selective_checkpoint" in rep.graphs[0].after_code


def test_selective_candidate_counts_what_must_be_kept_instead():
    """A candidate saves what its cheap ops produced for backward, less what it must keep in their
    place; the GEMM outputs it keeps are not counted as freed."""
    model, batch = _model()
    opt = opsmath.optimize(model, memory_budget=1.0)
    opt(*batch).backward()
    rec = opsmath.report(opt).graphs[0]
    gm = rec.graph
    by = saved_bytes_by_node(gm, [True] * len(gm.graph.find_nodes(op="placeholder")))
    order = forward_order(gm)
    segs = segments_of(gm, by)
    runs = runs_of(gm, segs)
    cands = [c for (i, j), r in runs.items() if j - i < 4 and (c := selective(order, r, saved_index(by.pairs))) is not None]
    assert cands and all(0 < c.saving <= c.saved for c in cands)
    assert max(c.saving for c in cands) < sum(by.values())


def test_gemms_policy_keeps_fused_ops_only():
    keep = policy("selective-gemms")
    assert keep(None, torch.ops.aten.mm.default) == CheckpointPolicy.PREFER_RECOMPUTE
    assert keep(None, torch.ops.opsmath.attention.default) == CheckpointPolicy.MUST_SAVE
    assert keep(None, torch.ops.aten.gelu.default) == CheckpointPolicy.PREFER_RECOMPUTE


def test_gemms_candidate_frees_more_than_keeping_gemms():
    """Recomputing a run's GEMMs too frees the GEMM outputs the plain selective candidate keeps: per run,
    at least as many bytes freed, at a higher modelled cost; attention outputs stay kept (less freed
    than recomputing the whole run)."""
    model, batch = _model()
    opt = opsmath.optimize(model, memory_budget=1.0)
    opt(*batch).backward()
    gm = opsmath.report(opt).graphs[0].graph
    by = saved_bytes_by_node(gm, [True] * len(gm.graph.find_nodes(op="placeholder")))
    order, index = forward_order(gm), saved_index(by.pairs)
    runs = runs_of(gm, segments_of(gm, by))
    both = [(selective(order, r, index), selective(order, r, index, "selective-gemms"), r)
            for (i, j), r in runs.items() if j - i < 2]
    pairs = [(a, b, r) for a, b, r in both if a is not None and b is not None]
    assert pairs and any(b.saving > a.saving for a, b, _ in pairs)
    assert all(b.saved >= a.saved and b.cost >= a.cost for a, b, _ in pairs)
    attends = [(b, r) for _, b, r in pairs if any(n.target is torch.ops.opsmath.attention.default
                                                  for n in order[r.start:r.end + 1])]
    assert attends and all(b.cost < r.cost for b, r in attends)


@pytest.mark.parametrize("inductor", [False, pytest.param(True, marks=needs_cxx)])
def test_gemms_selective_plan_is_chosen_and_exact(inductor, monkeypatch):
    """Only the GEMM-recomputing selective kind offered, attention made dear in the cost model: the plan
    at 0.5 takes it (whole recompute redoes attention), and training equals no plan, dropout on."""
    from opsmath.memory import plan_choice as plan_mod
    from opsmath.memory import segments, selective
    cost = segments.node_cost

    def dear(n):
        return cost(n) * (1e4 if n.target is torch.ops.opsmath.attention.default else 1.0)
    monkeypatch.setattr(segments, "node_cost", dear)
    monkeypatch.setattr(selective, "node_cost", dear)
    monkeypatch.setattr(plan_mod, "KEEPS", {"selective-gemms": selective.is_fused_compute})
    monkeypatch.setattr(plan_mod, "FINER_RUNS", 0)
    plan, rep = _planned_exactly(0.5, inductor)
    assert plan.gemms_recomputed and plan.kept + plan.transient <= 0.5 * plan.unconstrained, plan.to_dict()
    assert "keeping attention" in rep.render(width=200)


def test_vendor_sdpa_stand_in_is_costed_as_attention():
    """The rewrite's SDPA stand-in (CUDA graphs) is the attention family's op too: costed by its FLOPs at
    attention's measured rate (not by bytes moved), kept by selective runs, causal half of full."""
    from opsmath.kernels import spec_of
    from opsmath.kernels.attention.tuning import sdpa
    from opsmath.memory.selective import is_fused_compute
    spec = spec_of(sdpa)
    assert spec is spec_of(torch.ops.opsmath.attention.default) and spec.family == "attention"
    assert is_fused_compute(sdpa) and spec.efficiency < 1
    q = torch.empty(2, 4, 128, 64)
    full = spec.flops(q, q, q, None, False, 0.125, 0.0, "sdpa_cudnn")
    assert full == 4 * 2 * 4 * 128 * 128 * 64
    assert spec.flops(q, q, q, None, True, 0.125, 0.0, "sdpa_cudnn") == 4 * 2 * 4 * (128 * 129 // 2) * 64
    # opsmath.attention's own signature: (q, k, v, bias, mask, mask_fill, is_causal, ...)
    assert spec.flops(q, q, q, None, None, 0.0, True) == 4 * 2 * 4 * (128 * 129 // 2) * 64
