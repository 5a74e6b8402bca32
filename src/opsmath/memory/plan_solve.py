"""The exact solver behind ``plan.choose``: steps (a run of segments recomputed, recomputed selectively
or offloaded), a DP over positions and saving units that picks disjoint steps at the least modelled
cost, and the activation peak a choice reaches.

The peak model: activations kept by every segment are live at the start of backward; while a chosen
step's backward runs, what the segments up to it keep is still live (the later segments' were freed)
plus its own activations, back from a recompute or the host. The step's saving and that peak both
bound a choice. Gradients, where their timing is given (``after[k]``: the gradient bytes allocated once
backward reaches segment k, a suffix sum, non-increasing in k), are added at every point: segment p's
boundary holds what segments 0..p keep plus ``after[p]``, a step i..j's backward what segments up to j
keep, its activations and ``after[i]``. Without timing (``after`` all 0) they are in the resident
bytes (``plan.py``). ``head``: bytes live only at the end of the forward, beside everything kept and before any
gradient (the loss's workspace, measured: ``replan.py``), held at the last boundary alone. Recompute does run there:
``torch.utils.checkpoint`` in the segment's backward (op by op), and under Inductor AOTAutograd's
partition orders recomputed ops as autograd would run them (``reordering_to_mimic_autograd_engine``),
not all at the start of backward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from opsmath.memory.offload import step_cost
from opsmath.memory.segments import Segment


@dataclass(frozen=True)
class Step:
    """One choice of the DP for segments i..j: ``"recompute"`` (keeps only its inputs), ``"selective"``
    (its GEMMs kept and its cheap ops recomputed), ``"selective-gemms"`` (only its fused ops, such as
    attention, kept; GEMMs recomputed too), ``"selective-free"`` / ``"selective-tensors"`` (the ops named in
    ``only``: ``selective``), ``"offload"`` (a single segment, kept, its saved tensors on the host;
    ``"offload+casts"``: but for its parameters' low-precision copies, recomputed), ``"recompute+offload"``
    (recomputed, its inputs on the host), ``"casts"`` (a single segment, kept but for its parameters'
    low-precision copies, recomputed: ``weight_casts``), or a selective kind with ``"+casts"`` (both).
    ``size``: its activations live again while its backward runs (the transient)."""
    i: int
    j: int
    kind: str
    saving: int
    cost: float
    size: int
    only: frozenset | None = None   # a run's recomputed nodes, where named (``selective``)
    reads: frozenset = frozenset()   # (position, name): saved producers before it assumed kept (``finer``)
    sent: int = 0   # bytes it sends to the host (an offload step)
    late: bool = False   # an offload priced at its whole copy time (``plan_choice._late_priced``)


def _steps(segs: list[Segment], runs: dict, link: float | None, sel: dict | None = None) -> dict:
    """Every step that saves something, by first segment. Offload steps only with a host ``link``
    (bytes/s); their cost is the hidden copies' (``offload.step_cost``). ``sel``: (i, j, kind)
    -> run i..j's selective candidate of that kind, or a list of them (``selective.selective``, ``finer``)."""
    out: dict = {}
    for (i, j, kind), cands in (sel or {}).items():
        r = runs.get((i, j))
        for c in cands if isinstance(cands, list) else [cands]:
            # its GEMMs' weight copies: all the run's with "selective-gemms", those of the GEMMs it recomputes
            # (``c.casts``, in its saving) with "selective-tensors", else none
            own = r.casts if r is not None and kind == "selective-gemms" else c.casts
            casts = (r.casts - own) if r is not None else 0
            cast_cost = r.cast_cost * casts / r.casts if casts else 0.0
            if kind == "selective-gemms":
                out.setdefault(i, []).append(Step(i, j, kind, c.saving + own, c.cost + (r.cast_cost if r else 0.0),
                                                  c.saved + own))
                continue
            out.setdefault(i, []).append(Step(i, j, kind, c.saving, c.cost, c.saved, c.only, c.reads))
            if casts:   # the copies of the GEMMs it keeps recomputed too
                out[i].append(Step(i, j, f"{kind}+casts", c.saving + casts, c.cost + cast_cost, c.saved + casts,
                                   c.only, c.reads))
    for i, s in enumerate(segs):
        if s.casts and not s.fixed:   # kept, but the parameters' low-precision copies recomputed
            out.setdefault(i, []).append(Step(i, i, "casts", s.casts, s.cast_cost, s.casts))
    for (i, j), r in runs.items():
        if r.saving > 0:
            out.setdefault(i, []).append(Step(i, j, "recompute", r.saving, r.cost, r.saved))
        if link and r.inputs > 0:
            out.setdefault(i, []).append(Step(i, j, "recompute+offload", r.saved, r.cost + step_cost(r.inputs, link),
                                              r.saved, sent=r.inputs))
    if link:
        for i, s in enumerate(segs):
            if s.saved > 0:
                out.setdefault(i, []).append(Step(i, i, "offload", s.saved, step_cost(s.saved, link), s.saved,
                                                  sent=s.saved))
            if 0 < s.casts < s.saved and not s.fixed:   # its weights' copies recast, not sent and brought back
                out[i].append(Step(i, i, "offload+casts", s.saved, step_cost(s.saved - s.casts, link) + s.cast_cost,
                                   s.saved, sent=s.saved - s.casts))
    return out


def conflicts(segs: list[Segment], picked: list[Step]) -> list[Step]:
    """The picked steps that read a saved value from before them (``Step.reads``) which another picked
    step recomputes: a step covering its producer that recomputes it (a whole recompute, a selective
    run naming it, or one recomputing all its cheap ops, GEMM outputs counted too: the safe side)."""
    return [st for st in picked if _read_recomputed(segs, st, picked)]


def _read_recomputed(segs: list[Segment], st: Step, picked: list[Step]) -> bool:
    """A value ``st`` reads from before it (``st.reads``) is recomputed by the picked step covering its producer."""
    for p, name in st.reads:
        t = next((o for o in picked if segs[o.i].start <= p <= segs[o.j].end), None)
        if t is not None and t.kind not in ("casts", "offload", "offload+casts") and (t.only is None or name in t.only):
            return True
    return False


def credited(segs: list[Segment], picked: list[Step], held: dict) -> list[Step]:
    """``picked`` with each whole recompute whose inputs are saved anyway (``held``: (i, j) -> the run
    counted without them, ``selective.held_inputs``) credited with them, where no other picked step
    recomputes their producers (``conflicts``): the saving Inductor's partition then shows."""
    out = []
    for st in picked:
        h = held.get((st.i, st.j)) if st.kind == "recompute" else None
        if h is not None and h.saving > st.saving:
            cand = replace(st, saving=h.saving, reads=h.reads)
            if not _read_recomputed(segs, cand, picked):   # its reads lie before it: ``st`` covers none
                st = cand
        out.append(st)
    return out


def _max_saving(n: int, steps: dict, T: int) -> int:
    """The most bytes disjoint steps of size <= T can save (1-D DP over positions)."""
    best = [0] * (n + 1)
    for p in range(n):
        best[p + 1] = max(best[p + 1], best[p])
        for st in steps.get(p, ()):
            if st.size <= T:
                best[st.j + 1] = max(best[st.j + 1], best[p] + st.saving)
    return best[n]


def _solve(n: int, steps: dict, unit: float, prefix: list, limit: float,
           after: list | None = None, head: float = 0, kept: float | None = None) -> list[Step] | None:
    """Disjoint steps saving what ``limit`` needs at the least modelled cost, each taken only
    where the bytes live while its backward runs fit ``limit``: what segments up to its end keep, plus
    its own activations back (``prefix[j]``: bytes segments < j save unconstrained; the later segments'
    are freed by then), plus ``after[i]`` gradient bytes; and every segment boundary p where backward
    arrives (what segments 0..p keep, plus ``after[p]``; at the last one, the end of the forward, ``head``
    where that is more) fits ``limit`` too, and the last one ``kept`` where given. DP over positions and
    saving units (``dp[p][u]``: least cost over segments < p saving >= u units; savings rounded down to
    units, so the bounds hold; a state below a boundary's least saving is dropped), then a backtrack.
    None when no choice saves enough. NumPy rows: one vector update per step, O(steps x units)."""
    after = after or [0] * (n + 1)
    floor_of = {}   # a step's least saving so far (units) for its backward to fit
    for sts in steps.values():
        for st in sts:
            floor_of[st] = max(0, int(math.ceil((prefix[st.j + 1] + st.size + after[st.i] - limit) / unit)))
    # least saving (units) over segments 0..p for backward's arrival at p to fit: dp[p + 1]'s floor
    at = [*after[:max(0, n - 1)], max(after[n - 1], head)] if n else []   # the forward's end: no gradient yet
    edge = [max(0, int(math.ceil((prefix[p + 1] + at[p] - limit) / unit))) for p in range(n)]
    if kept is not None and n:   # a tighter bound on the end of the forward alone
        edge[-1] = max(edge[-1], int(math.ceil((prefix[n] + at[n - 1] - kept) / unit)))
    top = max([0, *floor_of.values(), *edge])
    dp = np.full((n + 1, top + 1), np.inf)
    dp[0, 0] = 0.0
    came = np.full((n + 1, top + 1), -1, dtype=np.int32)   # start p of the step that reached it
    took = np.full((n + 1, top + 1), -1, dtype=np.int32)   # -1: segment p kept, else the step's index
    new = np.empty(top + 1)
    for p in range(n):
        cur, nxt = dp[p], dp[p + 1]
        if p:
            cur[:edge[p - 1]] = np.inf   # every write to dp[p] is done: drop what breaks boundary p - 1
        better = cur < nxt
        nxt[better], came[p + 1][better], took[p + 1][better] = cur[better], p, -1
        for k, st in enumerate(steps.get(p, ())):
            w = min(int(st.saving // unit), top + 1)
            if w == 0:
                continue
            new[:w] = cur[0] + st.cost            # saving >= u for every u <= w: from "saving >= 0"
            new[w:] = cur[:top + 1 - w] + st.cost
            new[:floor_of[st]] = np.inf
            dst = dp[st.j + 1]
            better = new < dst
            dst[better], came[st.j + 1][better], took[st.j + 1][better] = new[better], p, k
    if n:
        dp[n, :edge[n - 1]] = np.inf
    cap = edge[n - 1] if n else 0   # the last boundary: every kept byte (the saving the whole step needs)
    ends = dp[n, cap:]
    best = ends.min()
    if not math.isfinite(best):
        return None
    # of the choices at the least cost (to rounding), the one that saves the most: the lowest peak, and
    # the same choice for a budget a unit apart (a fraction and the bytes it stands for)
    u = cap + int(np.flatnonzero(ends <= best + 1e-12 * abs(best))[-1])
    chosen, q = [], n
    while q > 0:
        p, k = int(came[q, u]), int(took[q, u])
        if k >= 0:
            st = steps[p][k]
            chosen.append(st)
            u = max(0, u - int(st.saving // unit))
        q = p
    return sorted(chosen, key=lambda st: st.i)


def _lowest_peak(segs: list[Segment], steps: dict, prefix: list, unit: float, hi: float,
                 after: list | None = None, head: float = 0) -> float:
    """The lowest peak of activations (and gradients by ``after``) any choice reaches, to within a
    unit: bisection on ``_solve``'s feasibility below ``hi`` (a peak known to be reachable)."""
    lo = 0.0
    while hi - lo > unit:
        mid = (lo + hi) / 2
        if _solve(len(segs), steps, unit, prefix, mid, after, head) is not None:
            hi = mid
        else:
            lo = mid
    return hi


def _peak(segs: list[Segment], picked: list[Step], after: list | None = None, head: float = 0) -> int:
    """The most activation bytes live at once with ``picked``: all that is kept (the start of backward),
    or, while a step's backward runs, what segments up to its end keep plus its own activations back;
    with ``after``, the gradient bytes allocated by each point are added, and ``head`` at the end of the
    forward (``_solve``'s model)."""
    after = after or [0] * (len(segs) + 1)
    at, kept, peak, i = {st.i: st for st in picked}, 0, 0, 0
    while i < len(segs):
        st = at.get(i)
        if st is None:
            kept += segs[i].saved
            peak = max(peak, kept + after[i])
            i += 1
            continue
        kept += sum(sg.saved for sg in segs[st.i:st.j + 1]) - st.saving
        peak = max(peak, kept + st.size + after[st.i], kept + after[st.j])
        i = st.j + 1
    return int(max(peak, kept + (max(after[len(segs) - 1], head) if segs else 0)))


def suffix(grads: list | None, n: int) -> list[int]:
    """``after[k]``: the gradient bytes allocated once backward reaches segment k (``grads[k]``: those
    segment k's backward allocates; backward runs from the last segment), with ``after[n] = 0``."""
    after = [0] * (n + 1)
    for k in range(n - 1, -1, -1):
        after[k] = after[k + 1] + (grads[k] if grads else 0)
    return after
