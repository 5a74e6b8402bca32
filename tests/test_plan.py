"""Recompute planning under memory_budget (CPU): budgets parse, plans honor them, a smaller budget never
gives a larger predicted peak, an infeasible budget is a clear error, and recompute leaves loss and every
gradient identical to no recompute, dropout on."""
import copy

import pytest
import torch

import opsmath
from opsmath import examples
from opsmath.memory.plan import InfeasibleBudget, parse_budget


@pytest.mark.parametrize("text,expected", [
    ("6GB", 6e9), ("6GiB", 6 * 2**30), ("512MiB", 512 * 2**20), ("1.5 gb", 1.5e9), ("4096", 4096.0),
    ("2g", 2e9), (123456, 123456.0), (6e9, 6e9), ("6e9", 6e9), ("1e3MiB", 1000 * 2**20)])
def test_parse_bytes(text, expected):
    assert parse_budget(text) == ("bytes", expected)


def test_parse_fraction_and_errors():
    assert parse_budget(0.5) == ("fraction", 0.5)
    assert parse_budget("0.5") == ("fraction", 0.5)          # as a config file or a CLI flag gives it
    assert parse_budget("50%") == ("fraction", 0.5)
    assert parse_budget(" .25 ") == ("fraction", 0.25)
    assert parse_budget("1.0") == ("fraction", 1.0) and parse_budget("1.5e9") == ("bytes", 1.5e9)
    for bad in (0.0, 1.5, -3, "six gigs", "5XB", True, "150%", "0%", "0GB", "2.5", ""):
        with pytest.raises(ValueError):
            parse_budget(bad)
    with pytest.raises(ValueError, match="memory_budget"):
        opsmath.optimize(torch.nn.Linear(2, 2), memory_budget="lots")


def _run(budget, dropout=0.1, seed=1):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = examples.gpt(batch_size=4, seq_len=64, n_layer=4, dropout=dropout)
    opt = opsmath.optimize(model, memory_budget=budget)
    torch.manual_seed(seed)
    loss = opt(*batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], opsmath.report(opt)


FRACTIONS = [1.0, 0.9, 0.75, 0.6, 0.5]


def _saved_bytes(model, batch) -> int:
    """Activation bytes autograd keeps from one forward of ``model``, measured: unique storages that
    pass through its saved-tensor hooks, parameters excluded (after a first step that compiles: the
    hooks are for the compiled graph's run, not its capture)."""
    model(*batch).backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*batch)
    loss.backward()
    return sum(saved.values())


def test_fraction_budgets_are_honored_and_monotone():
    peaks, measured = [], []
    for f in FRACTIONS:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, batch = examples.gpt(batch_size=4, seq_len=64, n_layer=4, dropout=0.1)
        opt = opsmath.optimize(model, memory_budget=f)
        measured.append(_saved_bytes(opt, batch))
        p = opsmath.report(opt).graphs[0].plan
        assert p.kept + p.transient <= f * p.unconstrained
        peaks.append(p.predicted_peak)
    assert all(a >= b for a, b in zip(peaks, peaks[1:])), peaks
    assert peaks[-1] < peaks[0]
    # what the plan predicts is what the step keeps: the tightest budget keeps measurably less
    assert measured[-1] < 0.8 * measured[0], measured


def test_absolute_budgets_are_honored():
    _, _, rep = _run(1.0)
    p = rep.graphs[0].plan
    for budget in (p.predicted_peak, int(p.resident + 0.7 * p.unconstrained)):
        _, _, rep2 = _run(int(budget))
        assert rep2.graphs[0].plan.predicted_peak <= budget


def test_infeasible_budget_names_the_smallest_feasible():
    with pytest.raises(InfeasibleBudget, match="smallest feasible"):
        _run(0.05)
    with pytest.raises(InfeasibleBudget, match="smallest feasible"):
        _run("1KB")


def test_recompute_leaves_loss_and_grads_identical_with_dropout():
    loss0, grads0, rep0 = _run(None)
    loss1, grads1, rep1 = _run(0.5)
    assert len(rep1.graphs[0].plan.chosen) > 0 and "opsmath_recompute" in rep1.graphs[0].after_code
    assert torch.equal(loss0, loss1)
    for a, b in zip(grads0, grads1):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_report_shows_the_plan():
    _, _, rep = _run(0.6)
    text = rep.render(width=80)
    assert "memory plan: budget 0.6" in text and "segments planned" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert rep.to_dict()["graphs"][0]["plan"]["chosen"]


def _probe_then_fresh(dropout=0.1):
    """The test GPT's plan at budget 1.0 (its resident and activation bytes, from which a test derives
    its budget), then a fresh, seeded copy of the model (dropout off) and its batch."""
    _, _, rep = _run(1.0, dropout=dropout)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = examples.gpt(batch_size=4, seq_len=64, n_layer=4, dropout=0.0)
    return rep.graphs[0].plan, model, batch


def _grown_resident(monkeypatch, extra):
    """Resident bytes as measured at the graph's first call, then ``extra`` more (optimizer state)."""
    from opsmath.runtime import budgets
    from opsmath.memory import replan
    real, calls = budgets.resident_bytes, []

    def resident(args, model):
        calls.append(1)
        return real(args, model) + (extra if len(calls) > 1 else 0)
    for module in (budgets, replan):
        monkeypatch.setattr(module, "resident_bytes", resident)


def test_second_call_replans_when_the_resident_memory_grew(monkeypatch):
    """Optimizer state appears after step 1: the plan is re-made once for the new resident bytes, and
    the step still computes what an unplanned step computes."""
    p, model, batch = _probe_then_fresh()
    budget = int(p.resident + 0.85 * p.unconstrained)
    _grown_resident(monkeypatch, int(0.1 * p.unconstrained))
    ref = copy.deepcopy(model)
    opt = opsmath.optimize(model, memory_budget=budget)
    opt(*batch).backward()
    first = opsmath.report(opt).graphs[0].plan
    first_code = opsmath.report(opt).graphs[0].after_code
    model.zero_grad()
    loss = opt(*batch)
    loss.backward()
    second = opsmath.report(opt).graphs[0].plan
    assert "resident" in second.replanned and second is not first
    assert opsmath.report(opt).graphs[0].after_code != first_code
    assert second.resident > first.resident and second.predicted_peak <= budget
    # less room: less kept (more, or merged, recompute) at a cost no lower
    assert second.kept + second.transient < first.kept + first.transient
    assert second.recompute_seconds >= first.recompute_seconds
    ref_loss = ref(*batch)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    opt(*batch)   # once only: a third call keeps the plan
    assert opsmath.report(opt).graphs[0].plan is second


def test_second_call_raises_when_the_budget_no_longer_fits(monkeypatch):
    p, model, batch = _probe_then_fresh()
    _grown_resident(monkeypatch, 10 * p.unconstrained)
    opt = opsmath.optimize(model, memory_budget=int(p.resident + 0.85 * p.unconstrained))
    opt(*batch).backward()
    with pytest.raises(InfeasibleBudget, match="no longer fits after step 1"):
        opt(*batch)


def test_memory_timeline_is_bounded_by_the_predicted_peak():
    for budget in (1.0, 0.6):
        _, _, rep = _run(budget)
        p = rep.graphs[0].plan
        tl = p.timeline()
        values = [b for _, _, b in tl]
        fwd = [b for phase, _, b in tl if phase == "forward"]
        assert max(values) <= p.predicted_peak and max(values) == p.expected_peak   # gradients' timing known
        base = p.resident - sum(p.grads)          # gradients come during backward
        assert sum(p.grads) > 0 and fwd == sorted(fwd) and fwd[-1] == base + p.kept   # forward only accumulates
        assert tl[-1] == ("backward", 0, p.resident)   # every activation freed, every gradient there
        assert sum(phase == "recompute" for phase, _, _ in tl) == len(p.chosen) + len(p.selective)
    assert "memory over the step" in rep.render(width=80)


def test_fractional_budget_keeps_its_plan_and_updates_its_prediction(monkeypatch):
    """A fraction of the activations does not depend on what else is resident: at the second call the
    plan stays, and its predicted peak counts the resident bytes measured then (optimizer state)."""
    extra = 12345678
    _grown_resident(monkeypatch, extra)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = examples.gpt(batch_size=4, seq_len=64, n_layer=4, dropout=0.0)
    opt = opsmath.optimize(model, memory_budget=0.5)
    opt(*batch).backward()
    rec = opsmath.report(opt).graphs[0]
    first, code, peak = rec.plan, rec.after_code, rec.plan.predicted_peak
    opt(*batch).backward()
    rec = opsmath.report(opt).graphs[0]
    assert rec.plan is first and rec.after_code == code and not first.replanned
    assert first.predicted_peak == peak + extra


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA peak statistics")
def test_first_step_is_measured_even_after_a_higher_peak_in_the_process():
    """An absolute budget resets CUDA's peak statistic at the graph's first call, so step 1's own peak is
    measured (and checked at the second call) although something earlier in the process peaked higher."""
    torch._dynamo.reset()
    big = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")   # an earlier, higher peak
    del big
    torch.manual_seed(0)
    model, batch = examples.gpt(batch_size=4, seq_len=64, n_layer=4, dropout=0.0)
    model, batch = model.cuda(), tuple(t.cuda() for t in batch)
    opt = opsmath.optimize(model, memory_budget="8GiB")
    for _ in range(2):
        opt(*batch).backward()
    plan = opsmath.report(opt).graphs[0].plan
    assert plan.measured_peak is not None and plan.measured_peak < 2**30, plan.measured_peak


def test_third_call_tightens_once_when_the_planned_step_went_over(monkeypatch):
    """Under an absolute budget the step after the (re-)plan is measured too; if it went over the
    budget, the plan is made once more with the excess taken off, and the numbers do not change."""
    from opsmath.memory import replan
    p, model, batch = _probe_then_fresh(dropout=0.0)
    budget = int(p.expected_peak - 0.1 * p.unconstrained)   # below the unconstrained step's timeline
    ref = copy.deepcopy(model)
    peak = {}
    monkeypatch.setattr(replan, "start_peak", lambda args: 0)
    monkeypatch.setattr(replan, "max_allocated", lambda args: peak["now"])
    opt = opsmath.optimize(model, memory_budget=budget)
    for now in (0, budget + int(0.1 * p.unconstrained)):   # step 1 as predicted, step 2 over
        peak["now"] = now
        opt(*batch).backward()
        model.zero_grad()
    first = opsmath.report(opt).graphs[0].plan
    loss = opt(*batch)
    loss.backward()
    third = opsmath.report(opt).graphs[0].plan
    assert third is not first and "tightened" in third.replanned
    assert third.kept + third.transient < first.kept + first.transient   # more (or merged) recompute
    # planned for the budget less the measured error, which its prediction then counts
    assert third.excess >= int(0.1 * p.unconstrained) and third.predicted_peak <= budget
    assert third.predicted_peak - third.excess <= budget - int(0.1 * p.unconstrained)
    ref_loss = ref(*batch)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_late_optimizer_state_is_replanned_under_gradient_accumulation(monkeypatch):
    """With gradient accumulation over 3 micro-batches the optimizer state appears before the fourth
    call, not the second: the resident bytes are re-checked at later calls too and the plan follows."""
    from opsmath.runtime import budgets
    from opsmath.memory import replan
    p, model, batch = _probe_then_fresh(dropout=0.0)
    budget = int(p.resident + 0.85 * p.unconstrained)
    real, stepped = budgets.resident_bytes, [False]

    def resident(args, m):   # the optimizer's first step (after 3 micro-batches) adds its state
        return real(args, m) + (int(0.1 * p.unconstrained) if stepped[0] else 0)
    for module in (budgets, replan):
        monkeypatch.setattr(module, "resident_bytes", resident)
    opt = opsmath.optimize(model, memory_budget=budget)
    plans = []
    for i in range(5):
        opt(*batch).backward()
        plans.append(opsmath.report(opt).graphs[0].plan)
        stepped[0] = stepped[0] or i == 2
    assert plans[0] is plans[1] is plans[2]          # nothing moved during the first micro-batches
    assert plans[3] is not plans[2] and "at call 4" in plans[3].replanned
    assert plans[3].kept + plans[3].transient < plans[2].kept + plans[2].transient
    assert plans[3].predicted_peak <= budget
    assert plans[4] is plans[3]


def test_infeasible_budget_message_speaks_in_sizes():
    """A byte budget is echoed in a readable unit, as is the smallest feasible one ('1000 B', not
    '0.000 GiB')."""
    import re
    from opsmath.memory.plan import _size
    assert (_size(1000), _size(1536), _size(3 * 2**20), _size(1.5 * 2**30)) == ("1000 B", "1.5 KiB", "3 MiB", "1.5 GiB")
    torch.manual_seed(0)
    model, batch = examples.gpt(batch_size=2, seq_len=16)
    opt = opsmath.optimize(model, memory_budget="1KB")
    with pytest.raises(InfeasibleBudget, match=r"memory budget 1000 B cannot be met: the smallest feasible is about "
                                               r"[0-9.]+ (KiB|MiB)") as e:
        opt(*batch)
    assert re.search(r"\(\d+ bytes", str(e.value))


def test_adjacent_segments_merge_down_to_the_per_block_floor():
    """Recomputing a run of adjacent segments as one keeps only the run's inputs, not every boundary
    inside it: a 6-block GPT reaches 0.3 of its activations (unmerged segments stopped at 0.39), some
    chosen segment spans several of the crossing-minima segments, the predicted peak holds the budget,
    and the step equals eager."""
    torch.manual_seed(0)
    model, (idx, tgt) = examples.gpt(batch_size=2, seq_len=128, dropout=0.0, n_layer=6)
    ref = copy.deepcopy(model)
    opt = opsmath.optimize(model, memory_budget=0.3)
    loss = opt(idx, tgt)
    loss.backward()
    ref_loss = ref(idx, tgt)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    plan = opsmath.report(opt).graphs[0].plan
    assert plan.kept + plan.transient <= 0.3 * plan.unconstrained


def test_solver_merges_runs_when_single_segments_cannot_reach_the_budget():
    """Four segments saving 100 bytes each, each keeping an 80-byte input when recomputed alone; a run
    keeps only its first input. Singles peak at 340 at best (three recomputed, the last kept: 3 x 80 +
    100; recomputing the fourth too would bring its 100 bytes back over 320 kept), more than 0.7 of 400
    = 280; a pair keeps 80 + 200 = 280. Its backward runs with what the segments up to it keep plus its own 200 bytes
    back: the first pair (80 + 200 = 280) fits, the second (200 + 80 + 200 = 480) does not, since
    segments before it are still held. The exact DP finds the first pair, a solver of single segments
    cannot, and merged() rebuilds the list."""
    from opsmath.memory.plan import choose, merged
    from opsmath.memory.segments import Segment
    segs = [Segment(3 * k, 3 * k + 2, 100, 80, 1.0) for k in range(4)]
    runs = {(i, j): Segment(segs[i].start, segs[j].end, 100 * (j - i + 1), 80, float(j - i + 1))
            for i in range(4) for j in range(i, 4)}
    picked, kept, trans, cost = choose(segs, runs, 0, "fraction", 0.7)
    assert [(st.i, st.j, st.kind) for st in picked] == [(0, 1, "recompute")]
    assert (kept, trans, cost) == (280, 0, 2.0)
    singles = {k: v for k, v in runs.items() if k[0] == k[1]}
    with pytest.raises(InfeasibleBudget, match="fraction 0.85"):
        choose(segs, singles, 0, "fraction", 0.7)
    out, chosen, offloaded = merged(segs, runs, picked)
    assert [(s.start, s.end) for s in out] == [(0, 5), (6, 8), (9, 11)] and chosen == [0] and offloaded == {}


def test_a_late_recompute_counts_what_earlier_segments_still_hold():
    """The peak while a recomputed segment's backward runs is what the segments up to it keep plus its
    activations: recomputing the first of two segments costs the same as the last, but only the first
    fits a budget of 60% (the last one's backward would find the first's 100 bytes still held)."""
    from opsmath.memory.plan import choose
    from opsmath.memory.segments import Segment
    segs = [Segment(0, 2, 100, 10, 1.0), Segment(3, 5, 100, 10, 1.0)]
    runs = {(0, 0): segs[0], (1, 1): segs[1]}
    picked, kept, trans, cost = choose(segs, runs, 0, "fraction", 0.6)
    assert [(st.i, st.j) for st in picked] == [(0, 0)] and (kept, kept + trans) == (110, 110)


def test_budget_is_one_target_in_two_units():
    """A fraction and the bytes it stands for are one target: the plan under 0.6 and the plan under its
    byte equivalent (resident + 0.6 * activations + the loss's workspace beside them) both predict a peak within it; the byte budget, planned
    against the gradients' timing, keeps at least what the fraction keeps (the fraction also promises a
    share of the activations); the report and the plan's JSON give both units."""
    _, _, rep = _run(0.6)
    by_frac = rep.graphs[0].plan
    as_bytes, share = by_frac.budget_both_units()
    assert share == 0.6 and as_bytes == int(by_frac.resident + 0.6 * by_frac.unconstrained + by_frac.beside)
    torch._dynamo.reset()
    _, _, rep2 = _run(as_bytes)
    by_bytes = rep2.graphs[0].plan
    assert abs(by_bytes.budget_both_units()[1] - 0.6) < 1e-6
    assert by_bytes.timed and not by_frac.timed
    assert by_bytes.kept >= by_frac.kept and max(by_bytes.predicted_peak, by_frac.predicted_peak) <= as_bytes
    d = by_bytes.to_dict()
    assert d["budget_bytes"] == as_bytes and abs(d["budget_share"] - 0.6) < 1e-6
    assert "0.60 of activations" in rep2.render(width=200)


def test_a_graph_at_its_floor_plans_at_the_lowest_share_a_plan_fits(monkeypatch):
    """The floor an infeasible fraction names is the solver's estimate (HF DeBERTa-v2: 0.303, where plans
    fit from 0.317 only, so that asking the named fraction named a higher one): a graph planned at its
    floor bisects for the lowest share a plan fits, and the step's error then names a fraction that fits."""
    from opsmath.memory import plan
    from opsmath.memory.segments import Segment
    fake = ("opsmath", None, ([], 100, 217, 1.0), {})
    fits = lambda share: fake if share >= 0.317 else None   # noqa: E731
    monkeypatch.setattr(plan, "best_option", lambda gm, options, resident, kind, share, *a, **k: (fits(share), None))
    monkeypatch.setattr(plan, "_least_kept", lambda gm, options, resident, share, link, index: fits(share))
    options = [("opsmath", [Segment(0, 1, 1000, 0, 1.0)])]
    best, note, share = plan._at_floor(None, options, 0, 0.3, [], InfeasibleBudget("x", 303))
    assert best is fake and 0.317 <= share < 0.317 + 1 / 1024 and "floor is 0.31" in note, (share, note)
