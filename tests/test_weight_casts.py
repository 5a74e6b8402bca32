"""The recompute plan's cheapest bytes under autocast (Inductor path, CPU): parameters' low-precision
copies (``weight_casts``) and the cheap ops recomputable from what is kept anyway (``"selective-free"``
runs). Each must free what the plan counts and leave the step's numbers exactly as they were."""
import functools
import shutil

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import opsmath
from opsmath.memory import analysis, plan_choice, weight_casts
from opsmath.memory.plan import clone_graph_module
from opsmath.runtime import backend, budgets
from tolerance import grads_close

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="Inductor on CPU needs a C++ compiler")


class Block(nn.Module):
    """A LLaMA MLP block: ``x + down(silu(gate(n)) * up(n))``, ``n = rmsnorm(x)``."""

    def __init__(self, d, h):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.gate, self.up = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        y = self.norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class LM(nn.Module):
    def __init__(self, v=96, d=48, h=136, n=4):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))
        self.head = nn.Linear(d, v, bias=False)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).float().flatten(0, 1), tgt.flatten())


def step(budget, monkeypatch=None, found=None, device="cpu"):
    """One bf16-autocast step of a fresh LM (fp32 weights) under ``budget``: (model, optimized, loss)."""
    if found is not None:
        real = analysis.partitioned_saved_bytes

        def record(gm, inputs):
            found["inputs"], found["saved"] = inputs, real(gm, inputs)
            return found["saved"]
        monkeypatch.setattr(budgets, "partitioned_saved_bytes", record)
    torch.manual_seed(0)
    model = LM().to(device)
    optimized = opsmath.optimize(model, memory_budget=budget, inductor=True)
    idx = torch.randint(0, 96, (3, 37), generator=torch.Generator().manual_seed(1)).to(device)   # odd sizes
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = optimized(idx, idx)
    loss.backward()
    return model, optimized, loss


@functools.cache
def captured(device="cpu"):
    """``step(1.0)`` once per process and device for the tests that read what it captured (they clone its
    graph before tagging it; test_plan_tensors.py too): (model, optimized, found)."""
    found = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend.offload, "link_for", lambda *a: None)   # on CUDA offload is a choice too
        model, optimized, _ = step(1.0, mp, found, device)
    return model, optimized, found


# the tests sharing ``captured`` run in one worker (``--dist loadgroup``), which captures it once
shares_capture = pytest.mark.xdist_group("weight_casts_capture")


def compiled_grads(graph, inputs, autocast=True, compiled=True):
    """Every parameter's gradient after one step of ``graph`` on ``inputs`` (Inductor, or op by op),
    under bf16 autocast or not."""
    params = [t for t in inputs if isinstance(t, torch.nn.Parameter)]
    for p in params:
        p.grad = None
    with torch.autocast(params[0].device.type, dtype=torch.bfloat16, enabled=autocast):
        run = clone_graph_module(graph)
        out = (backend.compile_fx(run, list(inputs)) if compiled else run)(*inputs)
    (out[0] if isinstance(out, (tuple, list)) else out).backward()
    return [p.grad.clone() for p in params]


@functools.cache
def untagged_grads(device="cpu"):
    """``compiled_grads`` of the captured graph as it is, under autocast: what a tagged copy is held to."""
    _, optimized, found = captured(device)
    return compiled_grads(opsmath.report(optimized).graphs[0].graph, found["inputs"])


def test_only_narrowing_casts_of_parameters_count():
    """A parameter's bf16 copy counts; a widening cast, a tangent's and an activation's from an earlier
    graph (an input, but not a parameter: recomputing its cast would keep the fp32 tensor alive) do not."""
    g = fx.Graph()
    w, h, x = g.placeholder("primals_1"), g.placeholder("primals_2"), g.placeholder("tangents_1")
    for p in (w, h, x):
        p.meta["val"] = torch.empty(4, 4)
    cast = torch.ops.prims.convert_element_type.default
    cases = [(w, torch.bfloat16, True), (w, torch.float64, False), (x, torch.bfloat16, False),
             (h, torch.bfloat16, False)]
    for src, dt, expected in cases:
        n = g.call_function(cast, (src, dt))
        n.meta["val"] = torch.empty(4, 4, dtype=dt)
        assert weight_casts.is_param_cast(n, frozenset({0})) is expected, (src.name, dt)


def test_an_activation_from_an_earlier_graph_is_not_a_weight_copy(monkeypatch):
    """A graph break hands the second graph an fp32 activation that its first linear casts to bf16: only
    the parameters' copies count as weight copies."""
    found = {}
    real = analysis.partitioned_saved_bytes

    def record(gm, inputs):
        out = real(gm, inputs)
        found.setdefault("graphs", []).append((out, [t for t in inputs if isinstance(t, torch.nn.Parameter)]))
        return out
    monkeypatch.setattr(budgets, "partitioned_saved_bytes", record)

    class Broken(LM):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(48, 48, bias=False)

        def forward(self, idx, tgt):
            x = self.blocks[0](self.emb(idx))
            torch._dynamo.graph_break()
            x = x + self.proj(x)   # autocast casts the graph's fp32 input x to bf16, and saves the copy
            for b in self.blocks[1:]:
                x = b(x)
            return F.cross_entropy(self.head(x).float().flatten(0, 1), tgt.flatten())
    torch.manual_seed(0)
    model = Broken()
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    optimized = opsmath.optimize(model, memory_budget=1.0, inductor=True)
    idx = torch.randint(0, 96, (3, 37))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        optimized(idx, idx).backward()
    assert len(found["graphs"]) == 2
    for saved, params in found["graphs"]:   # the embedding's table is read in fp32: no copy
        assert sum(saved.casts.values()) == sum(2 * p.numel() for p in params if id(p) in linear) > 0


@shares_capture
def test_inductors_partition_counts_the_weight_copies_apart():
    """Under autocast the partition saves a bf16 copy of every matmul weight; the analysis names them."""
    model, _, found = captured()
    copies = sum(2 * p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "emb" not in name)
    assert sum(found["saved"].casts.values()) == copies
    # not among the producers the selective candidates read: those are outputs of the nodes
    assert sum(b for _, _, b in found["saved"].pairs) + copies == sum(found["saved"].values())


def test_weight_copies_are_found_past_the_graphs_own_constants(monkeypatch):
    """A tensor built in ``forward`` becomes a constant of the captured graph (a buffer, as HF models'
    ``_tensor_constant0``), which AOTAutograd puts before the inputs: every matmul weight's copy still
    counts, the last ones included."""
    found = {}
    real = analysis.partitioned_saved_bytes

    def record(gm, inputs):
        found["buffers"], found["saved"] = dict(gm.named_buffers()), real(gm, inputs)
        return found["saved"]
    monkeypatch.setattr(budgets, "partitioned_saved_bytes", record)

    class Scaled(LM):
        def forward(self, idx, tgt):
            x = self.emb(idx) * torch.tensor([1.0])
            for b in self.blocks:
                x = b(x)
            return F.cross_entropy(self.head(x).float().flatten(0, 1), tgt.flatten())
    model = Scaled()
    idx = torch.randint(0, 96, (3, 37))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opsmath.optimize(model, memory_budget=1.0, inductor=True)(idx, idx).backward()
    assert found["buffers"]
    copies = sum(2 * p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "emb" not in name)
    assert sum(found["saved"].casts.values()) == copies


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_light_budget_recomputes_copies_and_the_activation_product_bit_exactly(monkeypatch, device):
    """At 0.9 the cheapest plan takes weight copies and a "selective-free" run (silu and the product,
    from the kept GEMM outputs): the compiled partition saves what the plan counts, and the loss and
    every gradient are bit-identical to the step without a budget."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(backend.offload, "link_for", lambda *a: None)   # on CUDA offload is a choice too
    monkeypatch.setattr(plan_choice, "FINER_RUNS", 0)   # no GEMM recomputed: test_plan_tensors.py has those
    ref, _, ref_loss = step(None, device=device)
    found = {}
    model, optimized, loss = step(0.9, monkeypatch, found, device)
    plan = opsmath.report(optimized).graphs[0].plan
    assert plan.casts and not plan.chosen
    free = [plan.segments[i].only for i in plan.selective if plan.segments[i].only is not None]
    assert free and all({n.rstrip("_0123456789") for n in only} == {"silu", "mul"} for only in free)
    with torch.autocast(device, dtype=torch.bfloat16):
        tagged = analysis.partitioned_saved_bytes(opsmath.report(optimized).graphs[0].graph, found["inputs"])
    assert sum(tagged.values()) == plan.kept < sum(found["saved"].values())
    assert sum(tagged.casts.values()) == sum(found["saved"].casts.values()) \
        - sum(plan.segments[i].casts for i in plan.casts)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if device == "cuda" and name == "emb.weight":   # Inductor's scatter-add: atomics, any order run to run
            assert grads_close(p.grad, q.grad, rtol=1e-5), name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_op_by_op_plans_take_neither():
    """Without Inductor autocast's cache holds the copies and a checkpoint re-runs every cheap op:
    no casts and no "selective-free" runs are planned."""
    torch.manual_seed(0)
    optimized = opsmath.optimize(LM(), memory_budget=0.6, inductor=False)
    idx = torch.randint(0, 96, (3, 37))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        optimized(idx, idx).backward()
    plan = opsmath.report(optimized).graphs[0].plan
    assert not plan.casts and all(plan.segments[i].only is None for i in plan.selective)


@shares_capture
def test_a_norms_bf16_copy_is_freed_with_the_norm():
    """Autocast's bf16 copy of a norm's output, saved inside the GEMMs it feeds, counts as made by the
    norm: a selective-free run recomputing the norm frees it (the joint-graph pass recomputes the copy
    with its source), the compiled partition saves exactly what the candidate says, and the gradients are
    bit-identical to the untagged graph's."""
    from opsmath.memory.plan_emit import tag_recompute
    from opsmath.memory.segments import Segment, forward_order
    from opsmath.memory.selective import saved_index, selective
    _, optimized, found = captured()
    saved, inputs = found["saved"], found["inputs"]
    assert any(m.startswith("rms_norm") and s.startswith("linear") for s, m, _ in saved.pairs)
    gm = clone_graph_module(opsmath.report(optimized).graphs[0].graph)
    order = forward_order(gm)
    # from block 0's residual add (the partition keeps its two inputs and recomputes it) to block 1's
    norm = next(i for i, n in enumerate(order) if n.name == "rms_norm_1")
    run = Segment(norm - 1, next(i for i, n in enumerate(order) if i > norm and n.name.startswith("add")), 0, 0, 0.0)
    cand = selective(order, run, saved_index(saved.pairs, tagged=True), "selective-free", tagged=True)
    assert cand is not None and {"add", "rms_norm_1"} <= cand.only
    tag_recompute(gm, [cand], [], [0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tagged = analysis.partitioned_saved_bytes(gm, inputs)
    # everything the run's recomputed ops made is freed (its inputs, counted as kept in case their own
    # segment recomputes them, stay saved by their nodes here)
    assert sum(saved.values()) - sum(tagged.values()) == cand.saved
    for a, b in zip(compiled_grads(gm, inputs), untagged_grads(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hugging_face_models_under_autocast_budgets_train_as_without(family):
    """Tiny HF LLaMA and GPT-2 (SDPA, fp32 weights, bf16 autocast, Inductor) under fractions 0.7 and
    0.4: plans with weight copies, selective-free runs and whole recomputes; the loss and every gradient
    as the step without a budget within bf16 recompute rounding (LLaMA's RMSNorm weights: 6e-3 relative,
    the same without the cheap steps; GPT-2: 1e-7)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    def make():
        torch.manual_seed(0)
        if family == "llama":
            return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                attn_implementation="sdpa"))
        return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa"))
    idx = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    results, plans = {}, []
    for budget in (None, 0.7, 0.4):
        model = make()
        optimized = opsmath.optimize(model, memory_budget=budget, inductor=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = optimized(input_ids=idx, labels=idx).loss
        loss.backward()
        results[budget] = loss, [p.grad for p in model.parameters()]
        if budget is not None:
            plans.append(opsmath.report(optimized).graphs[0].plan)
    assert any(p.casts for p in plans) and any(p.segments[i].only for p in plans for i in p.selective)
    for budget in (0.7, 0.4):
        torch.testing.assert_close(results[budget][0], results[None][0], rtol=1e-5, atol=1e-5)
        for a, b in zip(results[budget][1], results[None][1]):
            assert grads_close(a, b, rtol=1e-2 if family == "llama" else 1e-5), budget
