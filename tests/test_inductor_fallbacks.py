"""Under Inductor (``optimize(inductor=True)``; on CPU Inductor emits C++): the fallback ladder when Inductor
fails on a rewritten graph, rewrites declined because they measured slower than Inductor, and CPU graphs
kept away from a miscompile of Inductor's vectorized C++."""
import copy
import shutil

import pytest
import torch

import opsmath
from conftest import DEVICE
from test_inductor import pair, step_equals_eager

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="Inductor on CPU needs a C++ compiler")


def test_inductor_failure_on_the_rewritten_graph_falls_back_to_compiling_dynamos_graph(monkeypatch):
    """The fallback ladder: Inductor raising on the rewritten graph (injected: on any graph holding an
    opsmath op) leaves the step to Inductor on dynamo's graph, as ``torch.compile`` would run it; the step
    equals eager and the report names the failure and declines every rewrite with it."""
    from opsmath.runtime import backend
    real = backend.compile_fx

    def failing(gm, example_inputs, **kw):
        if any(str(n.target).startswith("opsmath.") for n in gm.graph.nodes):
            raise RuntimeError("injected lowering failure")
        return real(gm, example_inputs, **kw)
    rep = _step_with(monkeypatch, failing)
    assert rep.graphs[0].inductor and not rep.matches
    assert rep.declines and all("injected lowering failure" in d.reason for d in rep.declines)
    assert len(rep.fallback_errors) == 1 and "as torch.compile does" in rep.fallback_errors[0]
    assert "injected lowering failure" in str(rep)


def _step_with(monkeypatch, compile_fx):
    """A GPT optimized under Inductor with ``compile_fx`` in place of opsmath's compile: one step, equal to
    eager's; its report."""
    from opsmath.runtime import backend
    monkeypatch.setattr(backend, "compile_fx", compile_fx)
    ref, model, batch = pair(dropout=0.0)
    model = opsmath.optimize(model, inductor=True)
    step_equals_eager(model, ref, batch)
    return opsmath.report(model)


class LearnedBiasAttention(torch.nn.Module):
    """Attention with a learned (1, H, T, T) position bias, T5's kind: the bias needs its gradient."""

    def __init__(self, d=32, h=4, t=16):
        super().__init__()
        self.qkv, self.h = torch.nn.Linear(d, 3 * d), h
        self.bias = torch.nn.Parameter(torch.randn(1, h, t, t) * 0.1)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1) + self.bias, dim=-1)
        return (att @ v).pow(2).mean()


@pytest.mark.parametrize("budget", [None, 1.0])
def test_learned_bias_attention_is_left_to_inductor_unless_a_budget_asks(budget):
    torch.manual_seed(0)
    model, x = LearnedBiasAttention(), torch.randn(2, 16, 32)
    ref = copy.deepcopy(model)
    opt = opsmath.optimize(model, memory_budget=budget, inductor=True)
    step_equals_eager(opt, ref, (x,))
    rep = opsmath.report(opt)
    if budget is None:
        assert rep.count("attention") == 0
        assert any("needs its gradient" in d.reason for d in rep.declines if d.pattern == "attention")
    else:
        assert rep.count("attention") == 1


class HandsOnItsEmbedding(torch.nn.Module):
    """An embedding both returned and read by a matmul, as T5's position bias is when one block hands it
    to the next (one graph per block): Inductor's vectorized C++ scatter for the embedding's backward,
    fused with the sum of the two gradients, gives a wrong weight gradient (torch 2.13 CPU)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 2)

    def forward(self, idx, q):
        e = self.emb(idx)                                        # [S, S, H]
        return e.permute(2, 0, 1).unsqueeze(0).contiguous() @ q, e


def test_a_cpu_graph_gathering_rows_that_need_a_gradient_compiles_without_vectorization():
    """(On the GPU, ``OPSMATH_TEST_DEVICE=cuda``: the same graph through Triton's code, checked alike.)"""
    torch.manual_seed(0)
    eager = HandsOnItsEmbedding().to(DEVICE)
    idx, q = torch.randint(0, 16, (8, 8), device=DEVICE), torch.randn(2, 2, 8, 4, device=DEVICE)
    ours = opsmath.optimize(copy.deepcopy(eager), inductor=True)
    for m in (eager, ours):
        sum((y * torch.linspace(-1, 1, y.numel(), device=DEVICE).view(y.shape)).sum() for y in m(idx, q)).backward()
    torch.testing.assert_close(ours.emb.weight.grad, eager.emb.weight.grad, rtol=1e-5, atol=1e-6)
    assert opsmath.report(ours).graphs[0].inductor


def test_a_failure_dynamo_answers_with_a_graph_break_goes_back_to_dynamo(monkeypatch):
    """Inductor raising on both graphs with an error dynamo itself turns into a graph break (here a
    data-dependent output, injected) is handed back to dynamo, as ``torch.compile`` would have it, not run
    op by op: the step equals eager and the report says so."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from opsmath.runtime import backend
    real, failed = backend.compile_fx, []

    def failing(gm, example_inputs, **kw):   # the first two graphs: the rewritten one, then dynamo's
        if len(failed) < 2 and gm not in failed:
            failed.append(gm)
            raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)
        return real(gm, example_inputs, **kw)
    rep = _step_with(monkeypatch, failing)
    assert len(failed) == 2
    assert any("handed back to dynamo" in e for e in rep.fallback_errors)
    assert not any("op by op" in e for e in rep.fallback_errors)



def test_outside_a_dynamo_compile_a_graph_break_error_runs_the_graph_op_by_op():
    """A piece's first call or a recapture runs the ladder at the user's call, where no dynamo takes a
    graph-break error back: the rewritten graph runs op by op, as before that rung existed."""
    import types
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from opsmath.runtime import ladder

    def failing(gm, example_inputs, **kw):
        raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    record = types.SimpleNamespace(index=0, source=gm, matches=[], declines=[], inductor_seconds=0.0)
    state = types.SimpleNamespace(weight_casts={}, cuda_graphs=False, fallback_errors=[], graphs=[record])
    fn = ladder.finish(state, record, gm, [torch.randn(1, 2)], True, failing, graph_break=True)
    assert fn(torch.ones(1, 2)).shape == (1, 2) and "op by op" in state.fallback_errors[0]


class _Scan(torch.nn.Module):
    """torch's generic ``associative_scan`` (HF Mamba's scan under dynamo on CPU): dynamo traces it into
    ``torch.func.vmap`` ops, which the pre-dispatch lowering cannot follow (it baked traced values in)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        from torch._higher_order_ops.associative_scan import associative_scan
        a, b = torch.sigmoid(self.lin(x)), x * 2

        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]
        return associative_scan(combine, (a, b), dim=1, combine_mode="generic")[1].sum()


@pytest.mark.parametrize("inductor", [False, True], ids=["op_by_op", "inductor"])
def test_a_graph_the_lowering_cannot_follow_runs_as_torch_compile_would(inductor):
    torch.manual_seed(0)
    model, x = _Scan(), torch.randn(2, 6, 8)
    eager, opt = copy.deepcopy(model), opsmath.optimize(model, inductor=inductor)
    lo, le = opt(x), eager(x)
    lo.backward()
    le.backward()
    torch.testing.assert_close(lo, le)
    torch.testing.assert_close(model.lin.weight.grad, eager.lin.weight.grad)
    errors = opsmath.report(opt).fallback_errors
    assert len(errors) == 1 and "vmap" in errors[0], errors
    assert "nothing rewritten: every graph fell back" in opsmath.report(opt).render(width=140)
    assert ("compiled by Inductor without rewrites" in errors[0]) == inductor, errors


def test_a_lowered_graph_holding_a_traced_value_is_refused():
    from opsmath.capture.lower import _no_traced_constants
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    with torch._subclasses.FakeTensorMode() as mode:
        gm._tensor_constant0 = mode.from_tensor(torch.ones(2))
    with gm.graph.inserting_before(list(gm.graph.nodes)[-1]):
        gm.graph.get_attr("_tensor_constant0")
    with pytest.raises(RuntimeError, match="traced value"):
        _no_traced_constants(gm)


class _Cond(torch.nn.Module):
    """``torch.cond`` between two branches: a higher-order op opsmath does not lower."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.cond(h.sum() > 0, lambda t: torch.sin(t) * 2, lambda t: torch.cos(t) + 1, (h,))).sum()


def test_control_flow_left_unlowered_is_compiled_as_torch_compile_does():
    """Under Inductor a ``cond`` region is compiled by Inductor (not run op by op); both branches train as
    eager does."""
    torch.manual_seed(0)
    model = _Cond()
    eager, opt = copy.deepcopy(model), opsmath.optimize(model, inductor=True)
    for sign in (1, -1):
        x = torch.randn(4, 8) * sign
        lo, le = opt(x), eager(x)
        lo.backward()
        le.backward()
        torch.testing.assert_close(lo, le)
    torch.testing.assert_close(model.a.weight.grad, eager.a.weight.grad)
    rep = opsmath.report(opt)
    assert [r.reason for r in rep.eager_regions if r.kind == "higher-order op cond"] == [
        "compiled by Inductor, as torch.compile compiles it (not lowered: not rewritten)"], rep.eager_regions
    assert not rep.fallback_errors


class Smoothed(torch.nn.Module):
    """Label smoothing and a logit scale changed every step: floats Inductor's scalar pass cannot turn into
    tensors, so its first compile of the graph asks to start again (``TensorifyScalarRestartAnalysis``)."""

    def __init__(self):
        super().__init__()
        self.emb, self.body, self.head = torch.nn.Embedding(50, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 50)
        self.smoothing, self.scale = 0.0, 1.0

    def forward(self, ids):
        logits = self.head(torch.tanh(self.body(self.emb(ids)))) * self.scale
        return torch.nn.functional.cross_entropy(logits.view(-1, 50), ids.view(-1), label_smoothing=self.smoothing)


def test_a_scalar_restart_compiles_the_rewritten_graph_again_not_dynamos():
    """The restart signal is not a failure: the rewritten graph compiles at the second try, so the ladder
    drops no rewrite and the report names no failure; every step equals eager."""
    torch.manual_seed(0)
    ref = Smoothed()
    model = copy.deepcopy(ref)
    opt = opsmath.optimize(model, inductor=True)
    ids = torch.randint(0, 50, (2, 16))
    for step in range(3):
        model.smoothing = ref.smoothing = 0.05 * step
        model.scale = ref.scale = 1.0 + 0.3 * step
        step_equals_eager(model, ref, (ids,), run=opt)
        model.zero_grad()
        ref.zero_grad()
    assert not opsmath.report(opt).fallback_errors, opsmath.report(opt).fallback_errors
