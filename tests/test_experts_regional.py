"""Repeated expert loops traced once for all their modules (``patterns/experts/regional.py``): one
rewritten graph serves every layer's MoE, training equals eager, copies carry their own modules, and a
model under the threshold stays one graph."""
import copy
import pickle

import pytest
import torch

import opsmath
import opsmath.patterns.experts.regional as regional
from opsmath import examples
from tolerance import grads_close

pytestmark = pytest.mark.quick


def _model(n_layer=3, n_expert=4):
    torch.manual_seed(0)
    return examples.Mixtral(max_len=32, dim=32, n_layer=n_layer, n_head=4, n_kv_head=2, vocab_size=64,
                            n_expert=n_expert, top_k=2, hidden=16).train()


def _batch():
    tok = torch.randint(0, 64, (2, 16))
    return tok, torch.roll(tok, -1, 1)


@pytest.fixture
def low_threshold(monkeypatch):
    monkeypatch.setattr(regional, "REGIONAL_EXPERTS", 8)


def _trains_as_eager(model, rtol, device="cpu", **options):
    """``model`` optimized with ``options`` and a copy left eager, two steps each on ``device``: losses
    and every gradient within ``rtol``; the optimized model's report."""
    eager, opt = copy.deepcopy(model), opsmath.optimize(model, **options)
    for _ in range(2):
        tok, target = (t.to(device) for t in _batch())
        lo, le = opt(tok, target), eager(tok, target)
        lo.backward()
        le.backward()
        assert grads_close(lo.detach(), le.detach(), rtol)
    for (name, p), q in zip(opt.named_parameters(), eager.parameters()):
        assert grads_close(p.grad, q.grad, rtol), name
    return opsmath.report(opt)


def _experts_rewrites(rep) -> int:
    return sum(m.pattern == "experts" for g in rep.graphs for m in g.matches)


def test_one_graph_serves_every_layers_experts_and_trains_as_eager(low_threshold):
    rep = _trains_as_eager(_model(), 1e-5, inductor=False)
    assert _experts_rewrites(rep) == 1                        # rewritten once, for the three layers
    assert len(rep.graphs) > 1 and not rep.fallback_errors
    assert any("3 SparseMoE modules (layers.0.moe ... layers.2.moe" in n for n in rep.notes)
    load = rep.expert_load()
    assert [row["layer"] for row in load] == ["layers.0.moe ... layers.2.moe"]
    assert load[0]["calls"] == 2 * 3                           # two steps, three layers: pooled
    assert any("a repeated MoE module runs as its own graph" in r.reason for r in rep.eager_regions)


def test_rewritten_after_torch_compile_skipped_the_same_loop(low_threshold):
    """``torch.compile`` (any backend) skips a frame with a graph break in a loop, and dynamo keeps that per
    code object: opsmath's frame of the same class runs a copy of ``forward`` of its own."""
    other = torch.compile(_model(), backend="eager")
    other(*_batch()).backward()
    opt = opsmath.optimize(_model(), inductor=False)
    opt(*_batch()).backward()
    assert _experts_rewrites(opsmath.report(opt)) == 1


def test_copies_and_pickles_carry_their_own_modules(low_threshold):
    opt = opsmath.optimize(_model(), inductor=False)
    twin = copy.deepcopy(opt)
    for a, b in zip(opt.modules(), twin.modules()):
        if isinstance(a, examples.SparseMoE):
            assert a.forward.module is a and b.forward.module is b
    loaded = pickle.loads(pickle.dumps(opt))     # plain state, the experts' own graphs included
    assert all(m.forward.module is m for m in loaded.modules() if isinstance(m, examples.SparseMoE))
    batch = _batch()
    with torch.no_grad():
        assert torch.equal(twin(*batch), loaded(*batch))


def test_below_the_threshold_the_model_stays_one_graph():
    opt = opsmath.optimize(_model(n_layer=2, n_expert=4), inductor=False)
    assert not any(isinstance(m.__dict__.get("forward"), regional.OwnGraph) for m in opt.modules())
    opt(*_batch()).backward()
    assert len(opsmath.report(opt).graphs) == 1


@pytest.mark.parametrize("threshold", [8, 10**9], ids=["regional", "whole"])
def test_in_backward_steps_under_a_byte_budget_equal_adamw(monkeypatch, threshold):
    """Block pieces of a graph whose expert loops have data-dependent sizes: their floors are estimated
    (the loop's SymInt sizes once failed to hash), and the experts are never split into blocks."""
    monkeypatch.setattr(regional, "REGIONAL_EXPERTS", threshold)
    model = _model()
    eager, opt = copy.deepcopy(model), opsmath.optimize(model, memory_budget="64MiB", inductor=False)
    ours = opsmath.optim.AdamW(opt.parameters(), lr=1e-3, in_backward=True)
    ref = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    for _ in range(2):
        batch = _batch()
        opt(*batch).backward()
        ours.step()
        eager(*batch).backward()
        ref.step()
        ref.zero_grad()
    for (name, p), q in zip(opt.named_parameters(), eager.parameters()):
        assert p.grad is None and grads_close(p.detach(), q.detach(), 1e-5), name
    rep = opsmath.report(opt)
    assert not rep.fallback_errors
    assert _experts_rewrites(rep) == (1 if threshold == 8 else 3)


def test_the_environment_sets_the_threshold(monkeypatch):
    monkeypatch.setenv("OPSMATH_REGIONAL_EXPERTS", "8")
    opt = opsmath.optimize(_model(), inductor=False)
    assert all(isinstance(m.__dict__.get("forward"), regional.OwnGraph)
               for m in opt.modules() if isinstance(m, examples.SparseMoE))
    monkeypatch.setenv("OPSMATH_REGIONAL_EXPERTS", "0")      # off: one graph however many experts
    monkeypatch.setattr(regional, "REGIONAL_EXPERTS", 1)
    opt = opsmath.optimize(_model(), inductor=False)
    assert not any(isinstance(m.__dict__.get("forward"), regional.OwnGraph) for m in opt.modules())


def test_inductor_trains_as_eager_on_the_device(low_threshold, device):
    """The shared MoE graph and the pieces around it through Inductor (on the GPU under
    ``OPSMATH_TEST_DEVICE=cuda``: the Triton grouped GEMM or ``torch._grouped_mm`` in the shared graph)."""
    rep = _trains_as_eager(_model(n_layer=2).to(device), 1e-4, device, inductor=True)
    assert _experts_rewrites(rep) == 1
    assert all(g.inductor for g in rep.graphs) and not rep.fallback_errors


def _checkpointed(layer, x):
    return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)


class CheckpointedBlocks(torch.nn.Module):
    """MoE layers under a checkpoint called through a helper (no ``checkpoint(`` in ``forward``)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([examples.SparseMoE(16, 8, n_expert=4) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = x + _checkpointed(layer, x)
        return x.square().mean()


class CheckpointedInForward(CheckpointedBlocks):
    def forward(self, x):
        for layer in self.layers:
            x = x + torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return x.square().mean()


@pytest.mark.parametrize("hidden", [False, True], ids=["in_forward", "through_a_helper"])
def test_checkpointed_modules_are_never_silently_left_as_written(low_threshold, hidden):
    """A checkpoint runs its function with dynamo off, where no graph of its own can be captured: a model
    whose source checkpoints keeps its loops in its graph; one that hides it runs them as written, and
    the report says so."""
    torch.manual_seed(0)
    model = CheckpointedBlocks() if hidden else CheckpointedInForward()
    eager, opt = copy.deepcopy(model), opsmath.optimize(model, inductor=False)
    x = torch.randn(2, 5, 16)
    lo, le = opt(x), eager(x)
    lo.backward()
    le.backward()
    for p, q in zip(opt.parameters(), eager.parameters()):
        assert grads_close(p.grad, q.grad, 1e-5)
    rep = opsmath.report(opt)
    own = [m for m in opt.modules() if isinstance(m.__dict__.get("forward"), regional.OwnGraph)]
    if hidden:
        assert len(own) == 3 and any("ran 6 times with dynamo off" in n for n in rep.notes)
    else:
        assert not own and any("traced in the model's graph, not once for all: " in n for n in rep.notes)


def test_a_bad_threshold_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("OPSMATH_REGIONAL_EXPERTS", "many")
    with pytest.raises(ValueError, match="OPSMATH_REGIONAL_EXPERTS='many': an integer"):
        opsmath.optimize(_model(), inductor=False)
