"""Inductor composition: the rewritten graph compiled by Inductor (``optimize(inductor=True)``, the
default on CUDA), the memory plan passed to its partitioner as recompute tags, and an outer
``torch.compile(opsmath.optimize(model))``. On CPU Inductor emits C++ (needs a compiler)."""
import copy
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

import opsmath
from idioms_base import Checkpointed
from opsmath.examples import gpt

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="Inductor on CPU needs a C++ compiler")
CFG = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, seq_len=64, batch_size=2)


def pair(dropout):
    torch.manual_seed(0)
    ref, batch = gpt(dropout=dropout, **CFG)
    model, _ = gpt(dropout=dropout, **CFG)
    model.load_state_dict(ref.state_dict())
    return ref, model, batch


def step_equals_eager(model, ref, batch, run=None):
    """One forward+backward of ``model`` (through ``run`` when given, e.g. an outer compile of it) and of
    ``ref`` on ``batch``: the loss and every parameter's gradient equal eager's. Returns the loss."""
    loss = (run if run is not None else model)(*batch)
    loss.backward()
    ref_loss = ref(*batch)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    return loss


def saved_bytes(fn, exclude=()):
    """Bytes autograd saves for backward during ``fn()``, deduplicated by storage; the storages of the
    tensors in ``exclude`` (parameters: resident, not activations) left out."""
    seen, left_out = {}, {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(v for k, v in seen.items() if k not in left_out)


def test_inductor_matches_eager_and_keeps_the_rewrites():
    ref, model, batch = pair(dropout=0.0)
    model = opsmath.optimize(model, inductor=True)
    step_equals_eager(model, ref, batch)
    rep = opsmath.report(model)
    rec = rep.graphs[0]
    assert rec.inductor and rec.after_ops["opsmath.attention"] == 2
    assert rec.left_to_inductor == sorted(opsmath.api.INDUCTOR_FUSES_BETTER)
    assert "left to it: bias_gelu, cross_entropy, dropout_add_norm" in rep.render(width=200)


def test_budget_becomes_recompute_tags_that_inductor_honors():
    """Under a budget the partitioner saves less, and recompute (dropout on) changes nothing."""
    grads, saved = {}, {}
    for budget in (None, 0.6):
        _, model, batch = pair(dropout=0.1)
        model = opsmath.optimize(model, memory_budget=budget, inductor=True)
        model(*batch).backward()                       # capture and compile outside the hooks
        model.zero_grad()
        torch.manual_seed(1)
        loss, saved[budget] = saved_bytes(lambda: model(*batch))
        loss.backward()
        grads[budget] = [p.grad for p in model.parameters()]
        plan = opsmath.report(model).graphs[0].plan
        assert (plan is None) == (budget is None) and (plan is None or plan.chosen)
    assert saved[0.6] < 0.8 * saved[None], saved
    for a, b in zip(grads[None], grads[0.6]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_outer_torch_compile_runs_opsmath_without_graph_breaks():
    ref, model, batch = pair(dropout=0.0)
    optimized = opsmath.optimize(model, inductor=True)
    counters.clear()
    step_equals_eager(optimized, ref, batch, run=torch.compile(optimized))
    assert not counters["graph_break"]
    graphs = opsmath.report(optimized).graphs
    assert len(graphs) == 1 and graphs[0].after_ops["opsmath.attention"] == 2


@pytest.mark.slow
def test_second_call_replan_recompiles_with_new_tags(monkeypatch):
    """An absolute budget re-planned at the second call (resident grew: optimizer state) is compiled
    by Inductor again, with the new recompute tags; the step's numbers do not change."""
    from opsmath.runtime import budgets
    from opsmath.memory import replan
    ref, model, batch = pair(dropout=0.0)
    probe = opsmath.optimize(copy.deepcopy(ref), memory_budget=1.0, inductor=True)
    probe(*batch).backward()
    p = opsmath.report(probe).graphs[0].plan
    torch._dynamo.reset()
    real, calls = budgets.resident_bytes, []

    def resident(args, m):
        calls.append(1)
        return real(args, m) + (int(0.15 * p.unconstrained) if len(calls) > 1 else 0)
    for module in (budgets, replan):
        monkeypatch.setattr(module, "resident_bytes", resident)
    # below the unconstrained step's peak (gradients counted as backward allocates them) by 10% of the activations
    model = opsmath.optimize(model, memory_budget=int(p.expected_peak - 0.1 * p.unconstrained), inductor=True)
    model(*batch).backward()
    model.zero_grad()
    first = opsmath.report(model).graphs[0].plan
    step_equals_eager(model, ref, batch)
    rec = opsmath.report(model).graphs[0]
    assert rec.plan is not first and rec.plan.replanned
    assert rec.plan.kept + rec.plan.transient < first.kept + first.transient   # more recomputed for the new resident
    assert rec.inductor


def test_budget_keeps_the_chunked_loss_that_inductor_otherwise_gets():
    """Without a budget linear-CE is left to Inductor (faster there); under a budget it stays, since
    Inductor's version keeps the whole logits tensor for backward."""
    fired = {}
    for budget in (None, 1.0):
        ref, model, batch = pair(dropout=0.0)
        model = opsmath.optimize(model, memory_budget=budget, inductor=True)
        step_equals_eager(model, ref, batch)
        fired[budget] = opsmath.report(model).graphs[0].after_ops["opsmath.linear_cross_entropy"]
    assert fired == {None: 0, 1.0: 1}, fired


@pytest.mark.parametrize("family", ["swiglu", "bias_gelu", "scaled_softmax"])
def test_activation_families_compile_under_inductor_when_asked(family):
    """Left to Inductor by default, but ``patterns=[...]`` applies them there too: the ops are opaque
    extern kernels with fake implementations, and the step equals eager."""
    from test_patterns_activations import GPT2MLP, ReturnedProbs, SwiGLU
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = {"swiglu": SwiGLU, "bias_gelu": GPT2MLP, "scaled_softmax": ReturnedProbs}[family]()
    ref = copy.deepcopy(model)
    opt = opsmath.optimize(model, patterns=[family], inductor=True)
    x = torch.randn(2, 7, 16)
    out, ref_out = opt(x), ref(x)
    out.sum().backward()
    ref_out.sum().backward()
    rec = opsmath.report(opt).graphs[0]
    assert rec.inductor and rec.after_ops[f"opsmath.{family}"] == 1 and not opsmath.report(opt).fallback_errors
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


class _Loss(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x).square().mean()


def test_cuda_graphs_option_reaches_inductor(monkeypatch):
    """``cuda_graphs=True`` compiles with Inductor's CUDA-graph trees (``triton.cudagraphs``); on CPU
    tensors Inductor runs the graph without them, same numbers. It needs the Inductor path."""
    import torch._inductor.compile_fx as cfx
    real, patches = cfx.compile_fx, []

    def spy(gm, inputs, **kw):
        patches.append(kw.get("config_patches"))
        return real(gm, inputs, **kw)
    monkeypatch.setattr(cfx, "compile_fx", spy)
    torch.manual_seed(0)   # a small model: what is checked is the option's path, not the graph it compiles
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    ref, batch = copy.deepcopy(model), (torch.randn(4, 16),)
    model = opsmath.optimize(_Loss(model), inductor=True, cuda_graphs=True)
    step_equals_eager(model, _Loss(ref), batch)
    assert patches[0].get("triton.cudagraphs") is True   # (compile_fx then calls itself inside the patch)
    assert "for CUDA-graph replay" in opsmath.report(model).render(width=200)
    with pytest.raises(ValueError, match="cuda_graphs"):
        opsmath.optimize(torch.nn.Linear(2, 2), inductor=False, cuda_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_train_like_eager_and_draw_fresh_dropout():
    """On the GPU: 3 SGD steps replayed as CUDA graphs give eager's losses (dropout off), and with
    dropout on, two replays on one batch and one set of weights differ (masks are not frozen)."""
    torch.manual_seed(0)
    ref, batch = gpt(dropout=0.0, **CFG)
    ref, batch = ref.cuda(), tuple(t.cuda() for t in batch)
    model = opsmath.optimize(copy.deepcopy(ref), cuda_graphs=True)
    losses = []
    for m in (ref, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses.append([])
        for _ in range(3):
            loss = m(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[-1].append(loss.item())
    assert opsmath.report(model).graphs[0].cuda_graphs
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    torch.manual_seed(0)
    drop, _ = gpt(dropout=0.1, **CFG)
    drop = opsmath.optimize(drop.cuda(), patterns=opsmath.patterns.NAMES, cuda_graphs=True)
    seen = []
    for _ in range(4):
        loss = drop(*batch)
        loss.backward()
        seen.append(loss.item())
    assert len(set(seen[1:])) == 3, seen


def test_users_checkpoint_is_compiled_inline_and_recomputed():
    """Without a budget, on a graph Inductor compiles, a user's checkpointed blocks are inlined with
    recompute tags (as torch.compile lowers them): attention is rewritten inside, the step equals eager,
    and the blocks' activations are recomputed, not saved. The plain model is compiled first in the same
    process: a tagged graph must not be served the untagged twin's cached partition."""
    saved = {}
    for ck in (False, True):
        ref, model, batch = pair(dropout=0.0)
        if ck:
            model.h = torch.nn.ModuleList([Checkpointed(b) for b in model.h])
        model = opsmath.optimize(model, inductor=True)
        step_equals_eager(model, ref, batch)
        _, saved[ck] = saved_bytes(lambda: model(*batch))
        rep = opsmath.report(model)
        assert len(rep.graphs) == 1 and rep.count("attention") == 2
    regions = [r for r in rep.eager_regions if r.kind == "checkpoint"]
    assert len(regions) == 2 and all("compiled inline" in r.reason for r in regions)
    assert {n.meta.get("ac_graph_id") for n in rep.graphs[0].graph.graph.nodes} - {None} != set()
    assert saved[True] < 0.75 * saved[False], saved


def test_dynamo_settings_apply_inside_a_call_and_restore_after():
    """Each call of an optimized model runs with opsmath's dynamo settings and leaves the user's as they
    were (also when the call raises); a setting already at its value is not touched."""
    from opsmath.api import _dynamo_settings
    cfg = torch._dynamo.config
    before = (cfg.recompile_limit, cfg.optimize_ddp)
    with _dynamo_settings(dict(recompile_limit=before[0] + 7, optimize_ddp=before[1])):
        assert (cfg.recompile_limit, cfg.optimize_ddp) == (before[0] + 7, before[1])
    assert (cfg.recompile_limit, cfg.optimize_ddp) == before
    with pytest.raises(RuntimeError):
        with _dynamo_settings(dict(optimize_ddp=not before[1])):
            raise RuntimeError("inside")
    assert (cfg.recompile_limit, cfg.optimize_ddp) == before


# dynamo does not trace ``ctx.mark_dirty``: a graph break, the Function runs as Python
GRAPH_BREAKS = {"function_mark_dirty"}


@pytest.mark.parametrize("name", ["function_custom_backward", "function_gradient_reversal",
                                  "function_non_differentiable_output", "function_mark_dirty",
                                  "function_once_differentiable", "function_parameter_input",
                                  "function_straight_through"])
def test_autograd_functions_compiled_by_inductor_keep_their_backward(name):
    """Under Inductor a user ``autograd.Function`` is compiled as ``torch.compile`` compiles it (its
    custom backward kept: Square3's is 3x g x, not the derivative), or runs as traced; training equals
    eager's within fp32 rounding either way."""
    from semantics_idioms import IDIOMS, reduce_output
    from test_semantics import assert_trains_like_eager
    from opsmath.capture.regions import FUNCTION_COMPILED
    assert_trains_like_eager(IDIOMS[name], None, "fp32", inductor=True)
    model, batches = IDIOMS[name]()
    optimized = opsmath.optimize(model, inductor=True)
    reduce_output(optimized(*batches[0])).backward()
    rep = opsmath.report(optimized)
    functions = [r for r in rep.eager_regions if r.kind == "autograd.Function"]
    assert functions or name in GRAPH_BREAKS, "no autograd.Function region"
    assert all(r.reason == FUNCTION_COMPILED for r in functions), [r.reason for r in functions]
    assert not rep.fallback_errors, rep.fallback_errors


@pytest.mark.parametrize("budget", [1.0, 0.5])
def test_plan_under_inductor_is_made_for_what_its_partitioner_saves(budget):
    """HF LLaMA under bf16 autocast: eager's saved set overstates what Inductor keeps (norm intermediates,
    bf16 weight copies, activation outputs are recomputed by the min-cut partitioner); the plan is made
    from the partition itself, so its unconstrained bytes equal what the compiled step saves, and a
    planned step saves no more than the plan keeps."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (2, 128))
    optimized = opsmath.optimize(model, memory_budget=budget, inductor=True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return optimized(input_ids=ids, labels=ids, use_cache=False).loss
    run().backward()
    _, real = saved_bytes(run, exclude=list(model.parameters()))
    (graph,) = [g for g in opsmath.report(optimized).graphs if g.plan is not None]
    plan = graph.plan
    eager_estimate = graph.saved_bytes[1]
    if budget == 1.0:
        assert abs(plan.unconstrained - real) <= 0.02 * real, (plan.unconstrained, real)
        assert eager_estimate > 1.2 * real, (eager_estimate, real)
    else:
        assert real <= plan.kept * 1.02, (real, plan.kept)
        assert plan.kept + plan.transient <= 0.5 * plan.unconstrained + 4096


def test_function_region_stops_compiling_when_sizes_keep_changing(monkeypatch):
    """A Function region compiles once per input size, up to ``PIECE_SIZES``; past that it runs as
    traced (no Inductor compile per new length), and training stays exact."""
    from semantics_idioms import IDIOMS, reduce_output
    from opsmath.capture import pieces, regions
    monkeypatch.setattr(pieces, "PIECE_SIZES", 2)
    calls = []
    real = regions.hooks_off_while_tracing

    def counting():
        calls.append(1)
        return real()
    monkeypatch.setattr(regions, "hooks_off_while_tracing", counting)
    model, _ = IDIOMS["function_custom_backward"]()
    eager = copy.deepcopy(model)
    optimized = opsmath.optimize(model, inductor=True)
    for rows in (3, 4, 5, 6):
        x = torch.randn(rows, 8)
        reduce_output(optimized(x)).backward()
        reduce_output(eager(x)).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    # the static graph's piece compiled once (3 rows); the dynamic graph's for 4 and 5 rows, not for 6
    assert len(calls) == 3, len(calls)
    assert any("an autograd.Function region" in e and "more than 2 input sizes" in e
               for e in opsmath.report(optimized).fallback_errors)


@pytest.mark.parametrize("inductor", [False, True])
def test_pieces_between_regions_compile_once_with_symbolic_sizes(monkeypatch, inductor):
    """The lowered pieces around a Function compile for their first size, then, cut from dynamo's graph
    with symbolic sizes, once with symbolic sizes (through dynamo, which guards it): every later length
    runs compiled and rewritten, past ``PIECE_SIZES``, training exact, and no fallback note."""
    from semantics_idioms import IDIOMS, reduce_output
    from opsmath.capture import pieces
    monkeypatch.setattr(pieces, "PIECE_SIZES", 2)
    model, _ = IDIOMS["function_custom_backward"]()
    eager = copy.deepcopy(model)
    optimized = opsmath.optimize(model, inductor=inductor)
    for rows in (3, 4, 5, 6, 7, 9, 12):
        x = torch.randn(rows, 8)
        reduce_output(optimized(x)).backward()
        reduce_output(eager(x)).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    rep = opsmath.report(optimized)
    assert not [e for e in rep.fallback_errors if "a graph piece" in e], rep.fallback_errors
    # the static parent's two pieces (3 rows), then the dynamic parent's (dynamo's second trace, symbolic
    # sizes) once each with symbolic sizes from its first call (4 rows on): 4 compiles for 7 lengths
    assert len(rep.graphs) == 4, [g.input_shapes for g in rep.graphs]
    assert [g.dynamic for g in rep.graphs[-2:]] == [True, True]


def test_only_index_values_are_copied_into_pieces():
    """What a piece may compute again (``regions.index_only``): masks from sizes, ``arange`` and integer
    inputs, never a random op or a floating activation (a copy would redraw dropout or redo model compute)."""
    from opsmath.capture.regions import _chain, index_only
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x, ids):
        h = torch.nn.functional.dropout(x, 0.5) * 2
        i = torch.arange(h.size(1))
        return h, (ids > 0) & (i <= i[:, None])[None]
    torch.compile(f, backend=capture, dynamic=True)(torch.randn(2, 5), torch.randint(0, 3, (2, 5, 5)))
    gm = graphs[0]
    ok = index_only(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    floats = [n for n in gm.graph.nodes if n.op == "call_function" and n.meta["example_value"].is_floating_point()]
    assert floats and not any(n in ok for n in floats)   # dropout and its product
    mask = nodes["output"].args[0][1]   # the graph's second output
    chain, outside = _chain(mask, ok)
    assert mask in ok and not outside and not any(n in chain for n in floats), sorted(n.name for n in chain)


def test_tensor_operator_methods_count_as_index_values():
    """torch 2.11's dynamo records HF's mask ``==`` as ``call_method __eq__`` (2.13: ``operator.eq``): out-of-place
    operator methods are pure, so block pieces copy the causal mask's chain; in-place ones are not."""
    from opsmath.capture.regions import index_only
    g = torch.fx.Graph()
    ids = g.placeholder("ids")
    ids.meta["example_value"] = torch.zeros(2, 5, dtype=torch.int64)
    eq = g.call_method("__eq__", (ids, ids))
    both = g.call_method("__and__", (eq, eq))
    inplace = g.call_method("__iand__", (both, eq))
    g.output((both, inplace))
    ok = index_only(torch.fx.GraphModule(torch.nn.Module(), g))   # the chain, not the in-place update
    assert eq in ok and both in ok and inplace not in ok
