"""The plan's solver against brute force: on random small problems (segments, runs of them, costs), the
least modelled cost any set of disjoint recomputed runs reaches under the peak model (all kept bytes;
while a run's backward runs, what the segments up to it keep plus its activations) is what ``choose``
finds, and an infeasible budget's error names the lowest peak any choice reaches."""
import itertools
import random

import pytest

from opsmath.memory.plan import InfeasibleBudget, choose
from opsmath.memory.plan_solve import _peak, _steps, suffix
from opsmath.memory.segments import Segment


def _problem(rng, n):
    segs = [Segment(3 * k, 3 * k + 2, rng.randint(10, 100), rng.randint(0, 30), rng.uniform(0.5, 3.0))
            for k in range(n)]
    runs = {}
    for i in range(n):
        for j in range(i, min(n, i + 3)):
            saved = sum(s.saved for s in segs[i:j + 1])
            runs[(i, j)] = Segment(segs[i].start, segs[j].end, saved, segs[i].inputs,
                                   sum(s.cost for s in segs[i:j + 1]) * rng.uniform(0.8, 1.0))
    return segs, runs


def _brute(segs, runs, limit):
    """(least cost, lowest peak) over every set of disjoint runs; cost is inf when none fits ``limit``."""
    steps = [st for sts in _steps(segs, runs, None).values() for st in sts]
    best, lowest, total = float("inf"), float("inf"), sum(s.saved for s in segs)
    for r in range(len(steps) + 1):
        for pick in itertools.combinations(steps, r):
            spans = sorted((st.i, st.j) for st in pick)
            if any(a[1] >= b[0] for a, b in zip(spans, spans[1:])):
                continue
            peak = _peak(segs, sorted(pick, key=lambda st: st.i))
            lowest = min(lowest, peak)
            if peak <= limit and total - sum(st.saving for st in pick) <= limit:
                best = min(best, sum(st.cost for st in pick))
    return best, lowest


@pytest.mark.parametrize("seed", range(12))
def test_choose_finds_the_least_cost_any_choice_reaches(seed):
    rng = random.Random(seed)
    segs, runs = _problem(rng, rng.randint(4, 6))
    total = sum(s.saved for s in segs)
    for frac in (0.9, 0.7, 0.55, 0.4):
        limit = int(frac * total)   # integer bytes and total < 4096 units: the DP is exact
        best, lowest = _brute(segs, runs, limit)
        if best == float("inf"):
            with pytest.raises(InfeasibleBudget) as e:
                choose(segs, runs, 0, "bytes", limit)
            assert abs(e.value.floor - lowest) <= 1, (e.value.floor, lowest)
            continue
        picked, kept, trans, cost = choose(segs, runs, 0, "bytes", limit)
        assert cost == pytest.approx(best), (seed, frac, picked)
        assert kept + trans <= limit and kept + trans == _peak(segs, picked)


def _brute_timed(segs, runs, limit, after, head):
    """``_brute`` with gradients allocated as backward reaches each segment (``after``) and ``head`` bytes
    at the end of the forward."""
    steps = [st for sts in _steps(segs, runs, None).values() for st in sts]
    best, lowest = float("inf"), float("inf")
    for r in range(len(steps) + 1):
        for pick in itertools.combinations(steps, r):
            spans = sorted((st.i, st.j) for st in pick)
            if any(a[1] >= b[0] for a, b in zip(spans, spans[1:])):
                continue
            peak = _peak(segs, sorted(pick, key=lambda st: st.i), after, head)
            lowest = min(lowest, peak)
            if peak <= limit:
                best = min(best, sum(st.cost for st in pick))
    return best, lowest


@pytest.mark.parametrize("seed", range(12))
def test_choose_with_gradient_timing_matches_brute_force(seed):
    """Gradients allocated as backward reaches each segment: every boundary and every step's backward
    holds the gradients allocated by then, and the end of the forward a measured workspace (``head``).
    ``choose`` finds the least cost under that model, and an infeasible budget's floor is the lowest peak
    any choice reaches (the gradients all allocated at the end of backward included)."""
    rng = random.Random(100 + seed)
    segs, runs = _problem(rng, rng.randint(4, 6))
    grads = [rng.randint(0, 60) for _ in segs]
    after, head = suffix(grads, len(segs)), rng.choice([0, rng.randint(0, 120)])
    total = sum(s.saved for s in segs)
    for frac in (1.1, 0.9, 0.7, 0.55, 0.4):
        limit = int(frac * total)
        best, lowest = _brute_timed(segs, runs, limit, after, head)
        if best == float("inf"):
            with pytest.raises(InfeasibleBudget) as e:
                choose(segs, runs, after[0], "bytes", limit, grads=grads, head=head)
            assert abs(e.value.floor - lowest) <= 1, (e.value.floor, lowest)
            continue
        picked, kept, trans, cost = choose(segs, runs, after[0], "bytes", limit, grads=grads, head=head)
        assert cost == pytest.approx(best), (seed, frac, picked)
        assert _peak(segs, picked, after, head) <= limit
    # without recompute the peak is where it holds the most: the start of backward or its end
    assert _peak(segs, [], after) == max(p + a for p, a in zip(itertools.accumulate(s.saved for s in segs), after))
