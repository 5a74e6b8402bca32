"""Training loops under ``optimize(cuda_graphs=True)`` (``src/opsmath/runtime/cudagraphs.py``).

On CPU: the step guard's rules, with the CUDA-graph pool stood in for (which storages it owns). On the
GPU: every loop of ``benchmarks/cuda_graph_loops.py`` (gradient accumulation, in-place zeroing, kept
losses, an evaluation forward before the step, changing batch sizes, DDP) gives eager's losses and
weights."""
import os
import sys

import pytest
import torch

import opsmath
from opsmath.runtime import cudagraphs

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
from benchmarks import cuda_graph_loops as loops  # noqa: E402


def _pool_of(tensors, monkeypatch):
    """The pool, as the guard sees it, owning exactly ``tensors``' storages (on any device)."""
    ptrs = frozenset(t.untyped_storage().data_ptr() for t in tensors)
    monkeypatch.setattr(cudagraphs, "_pool_storages", lambda device: [ptrs])
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))


def test_guard_moves_pool_gradients_out_and_keeps_their_values(monkeypatch):
    model = torch.nn.Linear(4, 3)
    model.weight.grad, model.bias.grad = torch.randn(3, 4), torch.randn(3)
    kept = model.bias.grad
    cudagraphs.StepGuard(model)
    w_old = model.weight.grad
    _pool_of([w_old], monkeypatch)
    assert cudagraphs.StepGuard.before_call() == 1
    assert model.weight.grad is not w_old and torch.equal(model.weight.grad, w_old)
    assert model.weight.grad.untyped_storage().data_ptr() != w_old.untyped_storage().data_ptr()
    assert model.bias.grad is kept                 # not the pool's: left where it is
    assert cudagraphs.StepGuard.before_call() == 0   # moved once, then accumulated into in place


def test_guard_copies_small_pool_outputs_only(monkeypatch):
    loss = torch.tensor(2.5, requires_grad=True) * 2
    logits = torch.randn(cudagraphs.SMALL_OUTPUT_BYTES // 4 + 1)
    other = torch.randn(3)
    _pool_of([loss, logits], monkeypatch)
    out = cudagraphs.StepGuard.after_call({"loss": loss, "logits": logits, "other": other, "n": 3})
    assert out["loss"] is not loss and out["loss"].item() == 5.0 and out["loss"].requires_grad
    assert out["logits"] is logits and out["other"] is other and out["n"] == 3
    out["loss"].backward()                          # autograd flows through the copy


def test_report_says_why_inductor_did_not_replay_a_graph():
    """Inductor logs why it leaves a graph without CUDA graphs (CPU tensors, dynamic shapes, input
    mutation); the report of a model optimized with ``cuda_graphs=True`` shows the reason."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter
    model = opsmath.optimize(torch.nn.Linear(3, 3), cuda_graphs=True)
    plain = opsmath.optimize(torch.nn.Linear(3, 3))
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
    assert any("mutated inputs" in n for n in opsmath.report(model).notes)
    assert not any("mutated inputs" in n for n in opsmath.report(plain).notes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("loop", [*loops.LOOPS, "ddp"])
def test_cuda_graph_loop_trains_like_eager(loop):
    torch._dynamo.reset()
    torch.backends.cuda.matmul.allow_tf32 = False
    wrap = lambda m: opsmath.optimize(m, cuda_graphs=True)  # noqa: E731
    row = loops.run_loop(loop, loops.ddp(wrap) if loop == "ddp" else wrap, steps=8)
    if loop == "ddp":
        torch.distributed.destroy_process_group()
    assert row["ok"], row


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _Split(torch.nn.Module):
    """Two linears around a custom autograd.Function: two graph pieces."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(_Twice.apply(self.a(x).relu())).sum()


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("shutil").which("g++") is None,
                    reason="Inductor on CPU needs a C++ compiler")
def test_parameters_reach_inductor_as_static_inputs(monkeypatch):
    """AOTAutograd reads which inputs are parameters (static addresses: a CUDA-graph replay neither
    copies nor re-checks them) only from graphs dynamo made; the rewritten graph, and each piece of a
    graph split around an autograd.Function, must carry it, or every replay copies the weights."""
    import torch._functorch.aot_autograd as aot
    seen, real = [], aot._try_get_metadata_from_dynamo

    def spy(mod, *args):
        got = real(mod, *args)
        seen.append(got[1])
        return got
    monkeypatch.setattr(aot, "_try_get_metadata_from_dynamo", spy)
    torch._dynamo.reset()
    model = opsmath.optimize(_Split(), inductor=True)
    model(torch.randn(4, 8)).backward()
    # each piece: its weight and bias, not the activation; the Function's own piece (compiled by
    # Inductor as torch.compile compiles it) takes activations only
    assert seen == [[1, 2], [], [1, 2]], seen


class _WithConstant(torch.nn.Module):
    """A forward that builds a tensor constant (as HF's cache does with ``torch.tensor([])``): tracing
    keeps it as a buffer of the graph module, ``_tensor_constant0``."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        empty = torch.tensor([], dtype=x.dtype)
        return torch.cat([self.a(x).flatten(), empty]).sum()


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("shutil").which("g++") is None,
                    reason="Inductor on CPU needs a C++ compiler")
def test_parameters_stay_static_beside_traced_constants(monkeypatch):
    """A traced constant must not cost the parameters their static marking: without it Inductor's
    partition saves each weight's derived copies (FP8 casts) and every CUDA-graph replay copies weights."""
    import torch._functorch.aot_autograd as aot
    seen, real = [], aot._try_get_metadata_from_dynamo

    def spy(mod, *args):
        got = real(mod, *args)
        seen.append((sorted(n for n, _ in mod.named_buffers()), got[1]))
        return got
    monkeypatch.setattr(aot, "_try_get_metadata_from_dynamo", spy)
    torch._dynamo.reset()
    model = opsmath.optimize(_WithConstant(), inductor=True)
    x = torch.randn(4, 8)
    model(x).backward()
    (buffers, static), = seen
    assert buffers == ["_tensor_constant0"], seen
    assert len(static) == 3, seen      # the constant, the weight and the bias; not the activation
