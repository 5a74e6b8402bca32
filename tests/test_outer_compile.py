"""Compiling an optimized module again. An outer ``torch.compile`` of a module whose class is torch's own
(``nn.Sequential``, ``nn.TransformerEncoder``), or of a parent holding an optimized submodule: dynamo
called the class's forward directly, which skipped opsmath's frame (no rewrite, no memory plan, hooks
added later ignored). The optimized instance holds its own forward, so the outer compile calls the
module and opsmath runs. ``model.compile()`` would replace opsmath's compiled call: it is ignored with a
warning. Copies and pickles stay independent plain modules."""
import copy
import io

import pytest
import torch
import torch.nn as nn

import opsmath


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _encoder():
    torch.manual_seed(0)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)


@pytest.mark.parametrize("make,shape", [(_mlp, (3, 8)), (_encoder, (2, 5, 16))])
def test_outer_compile_of_a_torch_container_runs_opsmath(make, shape):
    ref, model = make(), make()
    optimized = opsmath.optimize(model, inductor=False)
    outer = torch.compile(optimized, backend="eager")
    x, r = torch.randn(*shape), torch.randn(*shape[:-1], 4 if make is _mlp else 16)
    (outer(x) * r).sum().backward()
    (ref(x) * r).sum().backward()
    assert len(opsmath.report(optimized).graphs) == 1, "opsmath's frame did not run under the outer compile"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    for m in (model, ref):   # a hook added afterwards runs, as in eager
        (m[0] if make is _mlp else m.layers[0]).register_forward_hook(lambda mod, a, o: o * 0.5 + 1)
    torch.testing.assert_close(outer(x), ref(x), rtol=1e-5, atol=1e-5)


def test_copies_and_pickles_of_an_optimized_container_are_their_own_modules():
    model = opsmath.optimize(_mlp(), inductor=False)
    x = torch.randn(3, 8)
    want = model(x).detach()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
    assert not torch.allclose(twin(x), want)           # the copy runs its own weights
    torch.testing.assert_close(model(x), want)          # and the original keeps its own
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x), want)
    assert loaded.forward.__self__ is loaded and twin.forward.__self__ is twin
    assert not {"_opsmath", "forward", "compile", "__getstate__"} & (set(loaded.__dict__) | set(twin.__dict__))


def test_weights_only_load_of_a_saved_optimized_module_needs_only_its_own_classes():
    model = opsmath.optimize(_mlp(), inductor=False)
    x = torch.randn(3, 8)
    want = model(x).detach()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.GELU]):
        loaded = torch.load(buf, weights_only=True)
    torch.testing.assert_close(loaded(x), want)


def test_module_compile_keeps_opsmath_and_copies_compile_as_usual(caplog):
    model = opsmath.optimize(_mlp(), inductor=False)
    with caplog.at_level("WARNING", logger="opsmath"):
        model.compile(backend="eager")
    assert "model.compile() on a module opsmath.optimize compiles already" in caplog.text
    model(torch.randn(3, 8))
    assert len(opsmath.report(model).graphs) == 1
    twin = copy.deepcopy(model)        # a plain module: Module.compile as usual
    twin.compile(backend="eager")
    assert twin._compiled_call_impl is not None and "compile" not in twin.__dict__   # the class's own
    torch.testing.assert_close(twin(torch.ones(3, 8)), model(torch.ones(3, 8)))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


class _Parent(nn.Module):
    """A model whose backbone alone is optimized, then compiled whole (a trainer's ``torch.compile``)."""

    def __init__(self):
        super().__init__()
        self.backbone = opsmath.optimize(_Block(), inductor=False)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.backbone(x))


def test_an_optimized_submodule_of_a_compiled_parent_runs_opsmath():
    torch.manual_seed(1)
    parent = _Parent()
    ref = copy.deepcopy(parent)            # plain modules (OptimizeState.__reduce__)
    x = torch.randn(3, 8)
    torch.compile(parent, backend="eager")(x).sum().backward()
    ref(x).sum().backward()
    assert len(opsmath.report(parent.backbone).graphs) == 1
    for p, q in zip(parent.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_a_forward_or_compile_of_the_instance_or_class_stays():
    """A forward already set on the instance (accelerate's output-casting wrapper) and a class's own
    ``compile`` (not ``nn.Module``'s) are the user's: optimize keeps them."""
    class OwnCompile(nn.Linear):
        def compile(self, optimizer=None):   # a framework's compile(), unrelated to torch.compile
            return "configured"
    model = OwnCompile(4, 4)
    model.forward = lambda x: nn.Linear.forward(model, x) * 2    # noqa: E731  (an instance wrapper)
    wrapper = model.forward
    opsmath.optimize(model, inductor=False)
    assert model.forward is wrapper and model.compile() == "configured"
    x = torch.randn(2, 4)
    torch.testing.assert_close(model(x), nn.Linear.forward(model, x) * 2)
