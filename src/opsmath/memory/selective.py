"""Selective recompute candidates below a whole run of segments (``plan_choice`` hands them to the DP of
``plan_solve`` as steps): a run keeps some of its ops' outputs and recomputes the rest in backward.

* ``"selective"``: its GEMMs and fused GEMM ops kept, every cheap op (norms, activations, casts) recomputed.
* ``"selective-gemms"``: its plain GEMMs recomputed too, only the fused ops (attention, the LM-head loss) kept.
* ``"selective-free"`` (a partitioner reads the tags): only the cheap ops computable from tensors saved anyway
  (``_free``): SwiGLU's product from its saved GEMM outputs, a norm from the saved residual. It keeps
  nothing in their stead.
* ``"selective-tensors"`` (``finer``): from the free ops, the producer of one saved tensor at a time is added
  to what the run recomputes, with the values it is computed from that nothing saves, the most bytes freed
  per modelled second first: a nested list of candidates, each a point on the run's cost/saving curve. On a
  LLaMA block the first is the mid-block residual (fp32) from the o_proj GEMM
  and the saved residual before it, the next the gate and up GEMMs from the recomputed norm: bytes a whole
  recompute of the block frees at 2-3 times its cost per byte. GEMMs such a candidate recomputes take their
  weights' low-precision copies with them (``weight_casts``: the copy is traced from the GEMM and takes its tag).

A candidate's ``saved``: the bytes its run's nodes keep for backward that its recomputed ops made (each
storage in its saver's segment, as ``Segment.saved`` counts it; live again while its backward runs);
``inputs``: what it keeps in their stead (inputs of recomputed ops nothing keeps, and any from outside the
run, which may be recomputed there; a ``"selective-tensors"`` run counts a saved one as kept, ``finer``);
``cost``: the recomputed ops' modelled time, with a partitioner
reading tags (``tagged``) only those backward needs (``_needed``)."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace

import torch.fx as fx

from opsmath.memory.segments import GEMMS, Segment, _LAUNCH_S, _BYTE_RATE, _nbytes, _storage, is_compute, node_cost

TENSORS = "selective-tensors"
FINER_STEPS = 6     # candidates per run of ``finer``'s nested list


def is_fused_compute(target) -> bool:
    """A fused op with GEMMs inside (attention, the LM-head loss), not a plain GEMM: what a selective run
    that recomputes its GEMMs still keeps (its recompute costs far more per byte it frees)."""
    return target not in GEMMS and is_compute(target)


# selective kind -> the op targets its runs keep (everything else in the run is recomputed; in a
# "selective-free" run only the cheap ops recomputable from what is kept anyway, ``_free``; in a
# "selective-tensors" one, those and the ops ``finer`` adds)
KEEPS = {"selective": is_compute, "selective-gemms": is_fused_compute, "selective-free": is_compute,
         TENSORS: is_compute}


def node_kept(kind: str, n: fx.Node) -> bool:
    """``n`` is an op a selective run of ``kind`` keeps (``KEEPS``), or an output of one."""
    if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n.op == "call_function" and KEEPS[kind](n.target)


@dataclass
class SavedIndex:
    """``analysis.SavedBytes.pairs`` as the selective candidates read it: ``by_saver[name]`` the
    (producer, bytes) of what that node saves, ``makers`` the nodes whose output something saves,
    ``casts`` the parameters' low-precision copies each node saves (``weight_casts``), ``copies`` the
    (saver, producer) pairs that are a copy of the producer's output made inside the saver, and
    ``outputs`` the producers whose output itself is saved."""
    by_saver: dict
    makers: set
    tagged: bool = False   # the plan becomes tags for a partitioner (it recomputes only what backward needs)
    casts: dict = field(default_factory=dict)
    copies: set = field(default_factory=set)
    outputs: set = field(default_factory=set)


def saved_index(pairs: list, tagged: bool = False, casts: dict | None = None, copies: set | None = None) -> SavedIndex:
    by_saver: dict = {}
    for saver, maker, nbytes in pairs:
        by_saver.setdefault(saver, []).append((maker, nbytes))
    copies = set(copies or ())
    return SavedIndex(by_saver, {maker for _, maker, _ in pairs}, tagged, dict(casts or {}), copies,
                      {maker for saver, maker, _ in pairs if (saver, maker) not in copies})


def _free(cheap: dict, index: SavedIndex, saved=None) -> dict:
    """The cheap ops (in order) recomputable from what the step saves anyway: each input an output
    something saves (a GEMM's, a residual a norm's backward reads), a graph input, or another such cheap
    op. An activation product from its saved GEMM outputs, a norm's output (whose bf16 copy the next GEMM
    saves, ``analysis``) from the saved residual; not a residual add whose other input nothing keeps.
    ``saved(x)``: ``x``'s value is saved (default: it produced saved bytes)."""
    free: dict = {}
    saved = saved or (lambda x: x.name in index.makers)
    for c in cheap:
        if all(x in free or x.op != "call_function" or saved(x) for x in c.all_input_nodes):
            free[c] = None
    return free


def _needed(cheap: dict, made: set) -> list:
    """Of ``cheap`` (in order), the ops a partitioner recomputes for backward: those whose output is
    saved (``made``) and the cheap ops they are computed from."""
    need, stack = set(), [c for c in cheap if c.name in made]
    while stack:
        c = stack.pop()
        if c not in need:
            need.add(c)
            stack.extend(x for x in c.all_input_nodes if x in cheap)
    return [c for c in cheap if c in need]


def _account(nodes: list, names: set, redo: dict, index: SavedIndex, kept_outside, tagged: bool,
             saved_value=None) -> tuple:
    """(saved, inputs, cost, made) of a run (``nodes``, their ``names``) recomputing ``redo`` (in order):
    see the module docstring. ``kept_outside(x)``: an input from before the run assumed kept there (else
    it counts in ``inputs``); ``saved_value(x)``: ``x`` is read back from what is saved (default: it is a
    producer of saved bytes). ``made``: the producers among ``redo`` whose bytes the run frees."""
    saved_value = saved_value or (lambda x: x.name in index.makers)
    redo_names = {n.name for n in redo}
    made_here = [(maker, b) for n in nodes for maker, b in index.by_saver.get(n.name, ()) if maker in redo_names]
    made, saved = {maker for maker, _ in made_here}, sum(b for _, b in made_here)
    extra = {}
    for c in redo:
        for x in c.all_input_nodes:
            if x in redo or x.op != "call_function":
                continue
            outside = x.name not in names and not kept_outside(x)
            if outside or not saved_value(x):
                extra[_storage(x)] = _nbytes(x)
    cost = sum(node_cost(n) for n in (_needed(redo, made) if tagged else redo))
    return saved, sum(extra.values()), cost, made


def selective(order: list[fx.Node], seg: Segment, index: SavedIndex, kind: str = "selective",
              tagged: bool = False) -> Segment | None:
    """``seg`` (a segment or a run of them) with its cheap ops recomputed and its GEMMs and fused GEMM
    ops kept, as a candidate (``plan.Step`` kind ``"selective"``; ``"selective-gemms"`` recomputes the
    plain GEMMs too, ``"selective-free"`` only the cheap ops ``_free`` finds: module docstring). ``only``:
    the recomputed ops of a ``"selective-free"`` run. None when that saves nothing or keeps nothing (the
    plain recompute of the run)."""
    nodes = order[seg.start:seg.end + 1]
    cheap = dict.fromkeys(n for n in nodes if not node_kept(kind, n))   # in order: the cost sums the same way each run
    if len(cheap) == len(nodes):
        return None   # it keeps nothing: that is the run's plain recompute candidate
    if kind == "selective-free":
        cheap = _free(cheap, index)
    saved, inputs, cost, _ = _account(nodes, {n.name for n in nodes}, cheap, index, lambda x: node_kept(kind, x),
                                      tagged)
    if saved <= inputs:
        return None
    only = frozenset(c.name for c in cheap) if kind == "selective-free" else None
    return Segment(seg.start, seg.end, saved, inputs, cost, only=only)


def _closure(node: fx.Node, redo: dict, inside: set, kept: set) -> set:
    """``node`` and what recomputing it needs beside ``redo``: its inputs in the run whose value nothing
    saves (``kept``: the saved storages), recursively (a saved input is read back; one from outside the
    run is kept by ``_account``)."""
    add, stack = set(), [node]
    while stack:
        x = stack.pop()
        if x in add or x in redo:
            continue
        add.add(x)
        stack.extend(y for y in x.all_input_nodes
                     if y in inside and y.op == "call_function" and _storage(y) not in kept)
    return add


def _with_casts(index: SavedIndex, redo, saved: int, cost: float) -> tuple[int, float, int]:
    """(saved, cost, casts) with the recomputed GEMMs' weight copies: they recompute with their GEMM."""
    casts = [c for n in redo if (c := index.casts.get(n.name, 0))]
    return saved + sum(casts), cost + len(casts) * _LAUNCH_S + 3 * sum(casts) / _BYTE_RATE, sum(casts)


def _tensors(nodes: list, index: SavedIndex, redo: dict, kept: set) -> tuple:
    """(net saving, saved, inputs, cost, casts) of a ``"selective-tensors"`` run recomputing ``redo``: a
    value is read back where its storage is saved (``kept``), from before the run too."""
    def saved_value(x):
        return _storage(x) in kept
    saved, inputs, cost, made = _account(nodes, {n.name for n in nodes}, redo, index, saved_value, True,
                                         saved_value)
    # a recomputed GEMM's copy of an input (autocast's, made inside it) recomputes with it: freed
    saved += sum(b for n in redo for m, b in index.by_saver.get(n.name, ())
                 if (n.name, m) in index.copies and m not in made)
    saved, cost, casts = _with_casts(index, redo, saved, cost)
    return saved - inputs, saved, inputs, cost, casts


def saved_storages(order: list[fx.Node], index: SavedIndex) -> set:
    """The storages of what something saves: an alias of a saved value (a no-op ``.to``, a view) reads it
    back too (``finer``)."""
    return {_storage(n) for n in order if n.name in index.outputs}


def origins(order: list[fx.Node]) -> dict:
    """Storage -> (position, name) of the first node in ``order`` that holds it: the producer an alias
    (a view, a no-op ``.to``) reads, as ``Segment.reads`` names it."""
    origin: dict = {}
    for k, n in enumerate(order):
        origin.setdefault(_storage(n), (k, n.name))
    return origin


def held_inputs(order: list[fx.Node], runs: dict, kept: set, origin: dict | None = None) -> dict:
    """For each whole-recompute run (``segments.runs_of``) of a graph whose saved bytes are read from a
    partitioner (``index.tagged``: attributed to their producers), the run with its inputs saved anyway
    taken out of ``inputs``: a value from before the run that something saves (``kept``, the storages of
    ``saved_storages``; a block's residual, saved for the norm that reads it) is counted at its producer
    already, and the run keeps it as a checkpoint input at no further cost, as long as its producer is
    kept. ``reads`` names those producers, (position, name): a chosen run is credited only where no other
    chosen step recomputes one (``plan_solve.credited``). Only runs that change: ``{(i, j): Segment}``.
    On HF LLaMA 1.1B (16 layers, a quarter of the activations) the plan counted 0.29 GiB it did not keep,
    a whole recompute's input each. ``origin``: ``origins(order)``, where already made."""
    origin = origin if origin is not None else origins(order)
    ins: list = [None] * len(order)   # per position: (storage, producer, bytes) of its inputs something saves

    def inputs_at(p):
        if ins[p] is None:
            ins[p] = [(st, origin[st], _nbytes(x)) for x in order[p].all_input_nodes
                      if x.op == "call_function" and (st := _storage(x)) in kept and st in origin]
        return ins[p]
    out, at, held, upto = {}, None, {}, 0
    for i, j in sorted(runs):   # runs i..j, j growing: each run's positions read once per i
        run = runs[(i, j)]
        if at != i:
            at, held, upto = i, {}, run.start
        for p in range(upto, run.end + 1):
            for st, src, nbytes in inputs_at(p):
                if src[0] < run.start:
                    held.setdefault(st, (src, nbytes))
        upto = run.end + 1
        if held:
            out[(i, j)] = replace(run, inputs=max(0, run.inputs - sum(b for _, b in held.values())),
                                  reads=frozenset(src for src, _ in held.values()))
    return out


def finer(order: list[fx.Node], seg: Segment, index: SavedIndex, kept: set, steps: int = FINER_STEPS,
          origin: dict | None = None) -> list[Segment]:
    """The ``"selective-tensors"`` candidates of the run ``seg`` (module docstring): up to ``steps`` nested
    recompute sets, each the last plus the saved tensor (its producer and the unsaved values it needs
    within the run) that frees the most net bytes per modelled second. A saved value from before the run
    that one reads (a block's residual) is assumed kept: ``reads`` names its producers, (position, name),
    and the solver drops a candidate whose plan recomputes one (``plan_choice.choose``); no candidate
    frees a value a later run reads. ``only``: the
    recomputed ops; ``casts``: the weight copies its GEMMs free (in ``saved``). ``kept``: the storages
    saved (``saved_storages``). For a partitioner reading tags (``index.tagged``)."""
    nodes = order[seg.start:seg.end + 1]
    inside, pos = set(nodes), {n: k for k, n in enumerate(nodes)}
    origin = origin if origin is not None else origins(order)   # a value from before the run: its producer
    # what a later run reads is never freed here: a candidate there may assume it kept
    escapes = {_storage(x) for x in nodes if any(u not in inside for u in x.users)}
    makers = [n for n in nodes if (n.name in index.makers or n.name in index.casts) and _storage(n) not in escapes]
    redo = _free(dict.fromkeys(n for n in nodes if not node_kept(TENSORS, n)), index, lambda x: _storage(x) in kept)
    cur, out = _tensors(nodes, index, redo, kept), []
    for _ in range(steps):
        best = None
        for m in makers:
            if m in redo:
                continue
            trial = dict.fromkeys(sorted([*redo, *_closure(m, redo, inside, kept)], key=pos.__getitem__))
            got = _tensors(nodes, index, trial, kept)
            gain, dc = got[0] - cur[0], got[3] - cur[3]
            rate = gain / dc if dc > 0 else float("inf")
            if gain > 0 and (best is None or rate > best[0]):
                best = (rate, trial, got)
        if best is None:
            break
        _, redo, cur = best
        if any(node_kept(TENSORS, n) for n in redo):   # cheap ops only: a plain selective candidate covers it
            reads = frozenset(origin[_storage(x)] for n in redo for x in n.all_input_nodes
                              if x not in inside and x.op == "call_function" and _storage(x) in kept)
            out.append(Segment(seg.start, seg.end, cur[1], cur[2], cur[3], casts=cur[4],
                               only=frozenset(n.name for n in redo), reads=reads))
    return out
