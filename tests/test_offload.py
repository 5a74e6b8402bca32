"""Offload, the plan's third choice (``src/opsmath/memory/offload.py``): the solver weighs the host copies
against recompute, reaches budgets below the recompute floor, and under Inductor the offloaded tensors
go through its partitioner's offload and training equals eager. On CPU the "host" is the same memory:
these tests check the choice, the marks and the exactness; the GPU rows in BENCHMARKS.md the speed."""
import contextlib
import shutil

import pytest
import torch

import opsmath
from opsmath.memory import offload
from opsmath.runtime import offload_async
from opsmath.memory.plan import InfeasibleBudget, Plan, by_kind, choose, merged
from opsmath.memory.segments import Segment
from test_inductor import pair, step_equals_eager

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                               reason="Inductor on CPU needs a C++ compiler")


@pytest.fixture(autouse=True)
def _default_prices(monkeypatch):
    """The prices and margins these tests work out by hand, whatever the environment asks."""
    for var in ("OPSMATH_OFFLOAD_EXPOSED", "OPSMATH_OFFLOAD_MARGIN", "OPSMATH_MEASURED_COSTS"):
        monkeypatch.delenv(var, raising=False)


def test_copies_are_priced_in_the_units_of_the_recompute_they_replace(monkeypatch):
    """A copy's out-and-back GPU seconds times ``EXPOSED_SHARE``, scaled by ``MODEL_SCALE`` against the
    model's recompute costs and by 1 against measured ones; the margin follows its variable."""
    modelled = offload.step_cost(10**9, 1e9)
    assert modelled == pytest.approx(offload.EXPOSED_SHARE * offload.MODEL_SCALE * 2)
    monkeypatch.setenv("OPSMATH_MEASURED_COSTS", "1")
    assert offload.step_cost(10**9, 1e9) == pytest.approx(modelled / offload.MODEL_SCALE)
    assert offload.margin() == offload.MARGIN
    monkeypatch.setenv("OPSMATH_OFFLOAD_MARGIN", "1.5")
    assert offload.margin() == 1.5


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


def test_offloads_the_forward_cannot_cover_are_priced_at_their_whole_copy():
    """Copies queue on one transfer stream from their segment's end and are covered when the forward's
    compute after them (4 s here) is ``offload.MARGIN`` times their copy time. At 150 bytes/s a 100-byte
    copy takes 2/3 s, covered for the first segment alone (its copy ends at 1 + 3 x 2/3 = 3 s, the
    second's at 5 s: late). A covered offload costs ``EXPOSED_SHARE`` of its 4/3 s out and back in the
    model's units (x ``MODEL_SCALE``: 0.53 s, less than the 1 s recompute); a late one all of it (2.7 s),
    more than recomputing, so the plan offloads the
    first segment (and the small inputs of a recomputed one) and recomputes the rest: no late copy is
    left in it."""
    segs, runs = _chain(cost=1.0)
    link = 150.0
    picked, kept, trans, _ = choose(segs, runs, 0, "fraction", 0.3, link=link)
    assert not [st for st in offload.late(segs, picked, link) if not st.late] and kept + trans <= 120
    assert sorted(st.i for st in picked if st.kind == "offload") == [0]
    every = _steps_of(segs, runs, link)
    assert offload.late(segs, [st for st in every if st.i == 3 and st.sent], link)
    assert not offload.late(segs, [st for st in every if st.i == 0 and st.kind == "offload"], link)


def _steps_of(segs, runs, link):
    from opsmath.memory.plan_solve import _steps
    return [st for sts in _steps(segs, runs, link).values() for st in sts]


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
    """A budget below GPT's recompute floor, with a (pretended) host link fast enough for the tiny model's
    compute to hide the copies: the plan offloads, the nodes are marked, the partitioned graphs get the
    copies (``offload_async``), and loss and every gradient equal eager."""
    fast = 1e15
    monkeypatch.setattr(offload, "link_for", lambda inputs, how: fast if how == "tag" else None)
    ref, model, batch = pair(dropout=0.0)
    probe = opsmath.optimize(pair(dropout=0.0)[1], memory_budget=0.3, inductor=True)
    with pytest.raises(InfeasibleBudget):
        monkeypatch.setattr(offload, "link_for", lambda inputs, how: None)
        probe(*batch)
    torch._dynamo.reset()
    monkeypatch.setattr(offload, "link_for", lambda inputs, how: fast if how == "tag" else None)
    before = len(offload_async.placements)
    model = opsmath.optimize(model, memory_budget=0.3, inductor=True)
    step_equals_eager(model, ref, batch)
    placed = offload_async.placements[before:]
    assert placed and all(p.names for p in placed)
    plan = opsmath.report(model).graphs[0].plan
    assert plan.offloaded and plan.offloaded_bytes > 0 and plan.kept + plan.transient <= 0.3 * plan.unconstrained
    assert offload.has_offload(opsmath.report(model).graphs[0].graph)
    assert "host memory" in opsmath.report(model).render(width=200)


def _blocks_step(mark: bool):
    """One compiled forward+backward of 8 MLP blocks (2048 tokens, 4096 -> 16384 -> 4096, bf16) on CUDA,
    the first two blocks' GEMM outputs marked for offload when ``mark`` (what the other blocks' compute
    can hide): (gradients, bytes the forward leaves allocated above the start, Placed)."""
    from torch._inductor.compile_fx import compile_fx
    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4096, 16384), torch.nn.GELU(),
                                                     torch.nn.Linear(16384, 4096)) for _ in range(8))
    blocks = blocks.cuda().to(torch.bfloat16)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def fwd(x):
        for b in blocks:
            x = x + b(x)
        return x.square().mean()

    def backend(gm, inputs):
        gemms = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
        for n in gemms[:4] if mark else []:
            n.meta["custom"] = {offload.OFFLOAD: True}
        with torch._functorch.config.patch(enable_autograd_cache=False), offload_async.offloading(gm, inputs):
            return compile_fx(gm, inputs)
    step = torch.compile(fwd, backend=backend)
    before = len(offload_async.placements)
    for _ in range(2):
        x.grad = None
        blocks.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = step(x)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        loss.backward()
    placed = offload_async.placements[before:]
    return ([p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()], kept, placed[0] if placed else None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the transfer stream runs on CUDA")
def test_transfer_stream_offload_trains_bit_equal_to_keeping():
    """The copies on the transfer stream change no value: every gradient equals the kept graph's bit for
    bit (same kernels; a missing wait would read a half-copied tensor), and what the forward leaves on the
    device for backward is less by the bytes sent (their waits all come before the forward's end). The
    step's peak is not the measure here: it comes at the end of backward, with every gradient and the
    reloaded first blocks' tensors live."""
    keep, keep_kept, _ = _blocks_step(mark=False)
    sent, sent_kept, placed = _blocks_step(mark=True)
    assert placed is not None and placed.names and not placed.late
    assert all(torch.equal(a, b) for a, b in zip(keep, sent))
    assert sent_kept <= keep_kept - placed.nbytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the transfer stream runs on CUDA")
def test_a_copy_source_freed_by_the_graph_is_still_copied_whole():
    """Inductor may compute a pointwise ``y`` into one buffer per custom op reading it and free
    ``offload_start``'s right after the call, its copy still running on the transfer stream (the generated
    code has ``del buf0`` there). The ops keep the source alive until ``offload_wait``: the next same-sized
    allocation, written at once on the compute stream, cannot take its block mid-copy. 64 MiB, ten times,
    bit for bit."""
    ops = torch.ops.opsmath
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(10):
        y = x.sin()
        h = ops.offload_start(y)
        del y                     # as the generated code does
        other = x * 2             # a 64 MiB block, written at once
        ops.offload_wait(h, other)
        r = ops.reload_start(h, other, list(x.shape), list(x.stride()), x.device)
        ops.reload_wait(r)
        assert torch.equal(r, x.sin())


def test_host_buffers_are_reused_only_once_nothing_refers_to_them():
    """``PinnedBuffers`` (unpinned here, on CPU): a buffer comes back for the next copy of its size once its
    views are gone, not while one is alive, in Python or saved for backward by autograd (C++)."""
    from opsmath.runtime.offload_ops import PinnedBuffers
    pool = PinnedBuffers(pin=False)
    h = pool.take((3, 5), torch.float32)
    ptr = h.data_ptr()
    assert pool.take((3, 5), torch.float32).data_ptr() != ptr           # h alive: a second buffer
    w = torch.randn(3, 5, requires_grad=True)
    loss = (h * w).sum()                                                 # h saved for backward
    del h
    taken = pool.take((3, 5), torch.float32)
    assert taken.data_ptr() != ptr and len(pool.by_size[60]) == 2       # the other, now free, comes back
    loss.backward()
    del loss, taken
    assert pool.take((3, 5), torch.float32).data_ptr() in {b.data_ptr() for b, _, _ in pool.by_size[60]}
    assert len(pool.by_size[60]) == 2 and pool.take((5, 3), torch.float32).shape == (5, 3)
    assert pool.take((2, 2), torch.bfloat16).data_ptr() not in {b.data_ptr() for b, _, _ in pool.by_size[60]}


def _llama_offloaded(monkeypatch, link: float):
    """HF LLaMA (SDPA, bf16 autocast, 2 layers) at 0.3 (its floor is 0.28) planned with a (pretended) host
    link of ``link`` bytes/s, one step beside eager's: (its plans, its placements), loss and gradients
    checked against eager's."""
    import copy
    import transformers
    from tolerance import grads_close, rel_err
    monkeypatch.setattr(offload, "link_for", lambda inputs, how: link if how == "tag" else None)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=172, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).train()
    eager = copy.deepcopy(model)
    before = len(offload_async.placements)
    opt = opsmath.optimize(model, memory_budget=0.3, inductor=True)
    ids = torch.randint(0, 256, (2, 128))
    losses = []
    for m in (opt, eager):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(m(input_ids=ids, labels=ids).loss)
        losses[-1].backward()
    assert rel_err(losses[0], losses[1]) < 1e-3
    for (name, p), q in zip(opt.named_parameters(), eager.parameters()):
        assert grads_close(p.grad, q.grad, 2e-2, 1e-3), name
    return [g.plan for g in opsmath.report(opt).graphs if g.plan is not None], offload_async.placements[before:]


@needs_cxx
def test_hf_llama_under_autocast_offloads_its_activations_not_its_weights(monkeypatch):
    """With a fast link the partition's saved tensors go through the transfer-stream ops (attention's
    outputs, GEMM outputs, norms' statistics, views of them), the weights' bf16 copies too (sending one
    costs less than recasting it at this link), and loss and gradients match eager's."""
    _, placed = _llama_offloaded(monkeypatch, 1e15)
    assert placed and placed[0].names and placed[0].input_casts > 0


@needs_cxx
def test_hf_llama_offloaded_segments_recast_their_weight_copies(monkeypatch):
    """Where a weight's bf16 copy costs less to recast than to send and back (launches nearly free, GEMMs
    dear, a 100 GB/s link), the offloaded segments recompute their weight copies (``"offload+casts"``):
    none of the sent tensors is a cast of a graph input, and training still matches eager."""
    from opsmath.memory import segments
    monkeypatch.setattr(segments, "_LAUNCH_S", 1e-12)
    monkeypatch.setattr(segments, "_FLOP_RATE", 1e6)
    plans, placed = _llama_offloaded(monkeypatch, 1e11)
    assert any(set(p.offloaded) & set(p.casts) for p in plans)
    assert placed and placed[0].names and sum(p.input_casts for p in placed) == 0


def test_a_view_of_a_graph_input_is_not_sent():
    """A weight's transpose saved for backward frees nothing when sent (the weight stays): not eligible,
    where a GEMM output and a view of it are."""
    import torch.fx as fx
    aten = torch.ops.aten
    g = fx.Graph()
    w = g.placeholder("w")
    t = g.call_function(aten.permute.default, (w, [1, 0]))
    m = g.call_function(aten.mm.default, (t, t))
    v = g.call_function(aten.view.default, (m, [16]))
    for n, val in ((w, torch.empty(4, 4)), (t, torch.empty(4, 4)), (m, torch.empty(4, 4)), (v, torch.empty(16))):
        n.meta["val"] = val
        n.meta["custom"] = {offload.OFFLOAD: True}
    assert [offload_async._eligible(n, False) for n in (t, m, v)] == [False, True, True]


@needs_cxx
def test_the_copy_source_is_one_buffer_inductor_keeps_until_the_wait(monkeypatch):
    """A pointwise tensor offloaded by Inductor's generated code: one buffer feeds ``offload_start`` and
    ``offload_wait`` (by default each op got its own copy, and the one being copied was freed right after
    ``offload_start``), and no kernel reuses that buffer in between."""
    import re
    from torch._inductor.utils import run_and_get_code
    from opsmath.runtime import offload_ops
    ops = torch.ops.opsmath
    offload_ops.lowerings()

    def f(x):
        y = x.sin()
        h = ops.offload_start(y)
        z = y.cos() + x @ x
        ops.offload_wait(h, y)
        r = ops.reload_start(h, z, list(y.shape), list(y.stride()), y.device)
        w = z * 2
        ops.reload_wait(r)
        return w, r
    torch._dynamo.reset()
    x = torch.randn(64, 64)
    with torch._inductor.config.patch(fx_graph_cache=False):
        (w, r), (code, *_) = run_and_get_code(torch.compile(f, backend="inductor"), x)
    assert torch.allclose(r, x.sin()) and torch.allclose(w, 2 * (x.sin().cos() + x @ x), atol=1e-5)
    start = re.search(r"offload_start\.default\((buf\d+)\)", code)
    wait = re.search(r"offload_wait\.default\(buf\d+, (buf\d+)\)", code)
    assert start and wait and start.group(1) == wait.group(1), code
    between = code[start.end():wait.start()]
    assert f"del {start.group(1)}" not in between and f"= {start.group(1)};" not in between, code


def _reloaded(anchors=None):
    """A backward whose three offloaded inputs are used together at its end, after 12 GEMMs and an early 256 KiB
    temporary (its memory peak); reloads placed over a link on which one copy takes two GEMMs of modelled
    time. ``anchors(loads) -> {placeholder: position}`` replaces the schedule (``_reload_anchors``)."""
    from unittest import mock
    from torch.fx.experimental.proxy_tensor import make_fx
    from opsmath.memory.segments import node_cost

    def bw(a, b, c, x, w):
        t = torch.cat([x] * 16).sum(0, keepdim=True)
        for _ in range(12):
            x = torch.mm(x, w)
        return (torch.stack([a, b, c]) * x).sum() + t.sum()
    gm = make_fx(bw)(*[torch.randn(64, 64) for _ in range(5)])
    for n in gm.graph.nodes:
        if isinstance(n.meta.get("val"), torch.Tensor):
            n.meta["val"] = torch.empty_like(n.meta["val"], device="meta")
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    link = 64 * 64 * 4 * offload.margin() / (2 * node_cost(mm))
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"][:3]
    with mock.patch.object(offload_async, "_reload_anchors", anchors) if anchors else contextlib.nullcontext():
        offload_async.reload_backward(gm, {k: ([64, 64], [64, 1], torch.device("meta")) for k in names}, link)
    order = list(gm.graph.nodes)
    starts = {n.args[0].name: order.index(n) for n in order if n.target is torch.ops.opsmath.reload_start.default}
    return starts, max(offload_async._live_bytes(order, {n: i for i, n in enumerate(order)}, set()))


def test_reloads_queue_latest_first_and_stay_under_the_graphs_own_peak():
    """Used together, the three copies queue on the one transfer stream: each starts at or before where it
    alone would (``own``, the schedule that ignored the queue), two of them earlier, one after another, and
    the graph's modelled live bytes stay under those of reloads made at their use (the early temporary's).
    Fails with the queue ignored (``queued == alone``)."""
    queued, peak = _reloaded()
    alone, _ = _reloaded(lambda order, pos, loads: {r[0]: r[3] for r in loads})
    at_use, peak_at_use = _reloaded(lambda order, pos, loads: {r[0]: pos[r[1]] - 1 for r in loads})
    assert all(queued[k] <= alone[k] for k in queued) and queued != alone, (queued, alone)
    assert len(set(queued.values())) == 3, queued   # one after another on the stream, not all at one node
    assert peak <= peak_at_use, (peak, peak_at_use)


def test_a_copy_the_forward_cannot_cover_is_named_with_its_shape():
    """A saved tensor made by the forward's last GEMM has no compute after it to hide its copy: it is
    waited for at once, counted late, and named (what it is, its shape) for the profile to show."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fw(x, w):
        a = torch.mm(torch.mm(x, w), w)
        return a.sum(), a
    gm = make_fx(fw)(torch.randn(64, 32), torch.randn(32, 32))
    last = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default][-1]
    last.meta["custom"] = {offload.OFFLOAD: True}
    placed, _ = offload_async.offload_forward(gm, 1, link=1.0)
    assert placed.late == 1 and placed.late_tensors[0].startswith(f"{last.name} (64, 32) torch.float32"), \
        placed.late_tensors


def test_an_offloaded_segment_recasts_its_weight_copies_instead_of_sending_them():
    """A kept segment's parameters' low-precision copies (``Segment.casts``, 40 of its 100 bytes here)
    cost less to recast in backward (1e-9 s) than to send out and back: at 0.3, below what recasting and
    recompute reach cheaply, the plan offloads segments but for their copies (``"offload+casts"``: 60
    bytes sent), and the merged choice marks them for both."""
    segs = [Segment(3 * k, 3 * k + 2, 100, 20, 1.0, casts=40, cast_cost=1e-9) for k in range(4)]
    runs = {(i, j): Segment(segs[i].start, segs[j].end, 100 * (j - i + 1), 20, 1.0 * (j - i + 1), casts=40 * (j - i + 1),
                            cast_cost=1e-9 * (j - i + 1)) for i in range(4) for j in range(i, 4)}
    picked, kept, trans, _ = choose(segs, runs, 0, "fraction", 0.3, link=1e8)
    sent = [st for st in picked if st.sent]
    assert sent and {st.kind for st in sent} == {"offload+casts"} and all(st.sent == 60 for st in sent)
    assert kept + trans <= 120
    out, chosen, kinds = merged(segs, runs, picked)
    assert "kept+casts" in kinds.values() and "kept" not in kinds.values()
    # in the plan's timeline such a segment comes back whole: its tensors reloaded, its weight copies recast
    plan = Plan(0.3, 0, 400, kept, trans, kept + trans, out, chosen, **by_kind(out, kinds, "tag"))
    points = plan.timeline()
    reloads = [(i, b - before) for (_, _, before), (ph, i, b) in zip(points, points[1:]) if ph == "reload"]
    assert reloads and all(back == out[i].saved for i, back in reloads)
