"""FP8 weight copies made once per optimizer step (``fp8="cached"``: ``opsmath.runtime.fp8_weights``, ``kernels.fp8_cast``): the
fused cast bit for bit against ``quantize``; under gradient accumulation the copies are reused by
micro-steps 2..k and made again after every optimizer step, and training is bit for bit that of casting
in every forward, whatever writes the weights."""
import copy

import pytest
import torch
import torch.nn as nn

import opsmath
from opsmath.kernels.fp8_cast import CastTables, cast_weights_reference, cast_weights_triton
from opsmath.kernels.fp8_linear import E4M3, quantize

pytestmark = pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without FP8 dtypes")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cast_is_quantize_bit_for_bit_on_odd_sizes(dtype):
    """Odd shapes, a tensor over several chunks, tiny and huge magnitudes, an all-zero (negative zeros)
    tensor: copies and scales equal ``quantize(bf16(W), e4m3)`` exactly."""
    torch.manual_seed(0)
    shapes = [((33, 17), 1e-3), ((70001,), 5.0), ((5, 3), -0.0), ((1000,), 1e4), ((7, 129), 1e-30)]
    ws = [(torch.randn(s, device=DEVICE) * k).to(dtype) for s, k in shapes]
    qs = [torch.empty(w.shape, dtype=E4M3, device=DEVICE) for w in ws]
    scales = [torch.zeros((), device=DEVICE) for _ in ws]
    cast_weights_triton(CastTables(ws, qs, scales))
    for w, q, s in zip(ws, qs, scales):
        ref_q, ref_s = quantize(w.to(torch.bfloat16), E4M3)
        assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(s, ref_s), (w.shape, s, ref_s)


def test_reference_cast_writes_in_place_without_bumping_versions():
    w = torch.randn(16, 32)
    q, s = torch.empty(16, 32, dtype=E4M3), torch.zeros(())
    before = q._version
    cast_weights_reference([w], [q], [s])
    assert q._version == before and torch.equal(_bits(q), _bits(quantize(w.bfloat16(), E4M3)[0]))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _train(model, batches, accumulate: int, write=None):
    """AdamW steps of ``accumulate`` micro-batches each under bf16 autocast; ``write(model)`` after each
    step. Returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i, x in enumerate(batches):
        with torch.autocast(DEVICE, torch.bfloat16):
            loss = model(x).float().pow(2).mean() / accumulate
        loss.backward()
        losses.append(loss.detach())
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
            if write is not None:
                with torch.no_grad():
                    write(model)
    return torch.stack(losses)


def _recast_against_reuse(monkeypatch, **options):
    """The MLP trained twice with ``fp8="cached"`` and ``options``, 2 steps of 3 micro-batches: once with
    every copy made again in every forward, once reusing them; asserts equal losses. Returns the model,
    the batches and both optimized copies (recast first)."""
    monkeypatch.setattr("opsmath.patterns.fp8_linear.MIN_DIM", 32)
    torch.manual_seed(0)
    model = MLP().to(DEVICE)
    batches = [torch.randn(4, 16, 64, device=DEVICE) for _ in range(6)]
    torch._dynamo.reset()
    every = opsmath.optimize(copy.deepcopy(model), fp8="cached", **options)
    cached = opsmath.optimize(copy.deepcopy(model), fp8="cached", **options)
    with monkeypatch.context() as m:
        m.setattr("opsmath.runtime.fp8_weights._Copy.fresh", lambda self, w: False)
        l_every = _train(every, batches, 3)
    assert every._opsmath.weight_casts.reused == 0
    assert torch.equal(l_every, _train(cached, batches, 3))
    return model, batches, every, cached


@pytest.mark.parametrize("inductor", [False, True])
def test_accumulation_reuses_copies_and_trains_as_casting_every_forward(monkeypatch, inductor):
    """Three micro-steps per optimizer step: each weight is cast once per step (micro-steps 2 and 3
    reuse the copy), and losses and weights equal those of casting again in every forward. (Casting
    inside the graph instead, ``skip=["fp8_weight_cache"]``, is the same op by op; Inductor may skip the
    bf16 rounding of an fp32 master weight there, within FP8's own error.)"""
    if inductor and DEVICE == "cpu" and __import__("shutil").which("g++") is None:
        pytest.skip("Inductor on CPU needs a C++ compiler")
    model, batches, every, cached = _recast_against_reuse(monkeypatch, inductor=inductor)
    for p, q in zip(every.parameters(), cached.parameters()):
        assert torch.equal(p, q)
    casts = cached._opsmath.weight_casts
    matches = [m for m in opsmath.report(cached).matches if m.pattern == "fp8_linear"]
    assert [m.details["weight_cast"] for m in matches] == ["once per optimizer step"] * 2
    assert casts.reused == 2 * 4, (casts.casts, casts.reused)     # 2 weights x micro-steps 2, 3 of 2 steps
    for options in (dict(fp8=True), dict(fp8="cached", skip=["fp8_weight_cache"])):   # the default; skipped
        in_graph = opsmath.optimize(copy.deepcopy(model), inductor=inductor, **options)
        _train(in_graph, batches[:1], 1)
        assert [m.details["weight_cast"] for m in opsmath.report(in_graph).matches
                if m.pattern == "fp8_linear"] == ["every forward"] * 2
        assert in_graph._opsmath.weight_casts.casts == 0


def test_weights_written_behind_the_version_counter_are_cast_again(monkeypatch):
    """A write through ``.data`` after each optimizer step (weight clipping) is invisible to the version
    counter; ``zero_grad`` ends the accumulation chain, so the next forward casts the clipped weights."""
    monkeypatch.setattr("opsmath.patterns.fp8_linear.MIN_DIM", 32)
    torch.manual_seed(0)
    model = MLP().to(DEVICE)
    batches = [torch.randn(4, 16, 64, device=DEVICE) for _ in range(6)]

    def clip(m):
        for p in m.parameters():
            p.data.clamp_(-0.05, 0.05)
    torch._dynamo.reset()
    every = opsmath.optimize(copy.deepcopy(model), fp8=True, inductor=False)
    cached = opsmath.optimize(copy.deepcopy(model), fp8="cached", inductor=False)
    assert torch.equal(_train(every, batches, 2, clip), _train(cached, batches, 2, clip))
    for p, q in zip(every.parameters(), cached.parameters()):
        assert torch.equal(p, q)


def test_two_forwards_before_one_backward_keep_their_gradients(monkeypatch):
    """Two forwards of the same weights before one backward (a contrastive pair): the second forward casts
    again (no backward since), which must not disturb what the first saved."""
    monkeypatch.setattr("opsmath.patterns.fp8_linear.MIN_DIM", 32)
    torch.manual_seed(0)
    model = MLP().to(DEVICE)
    a, b = torch.randn(4, 16, 64, device=DEVICE), torch.randn(4, 16, 64, device=DEVICE)
    torch._dynamo.reset()
    every = opsmath.optimize(copy.deepcopy(model), fp8=True, inductor=False)
    cached = opsmath.optimize(copy.deepcopy(model), fp8="cached", inductor=False)
    for m in (every, cached):
        with torch.autocast(DEVICE, torch.bfloat16):
            (m(a).float() - m(b).float()).pow(2).mean().backward()
    for p, q in zip(every.parameters(), cached.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_gradient_moved_out_of_the_replay_pool_keeps_the_copy_fresh():
    """CUDA graphs (``cudagraphs.StepGuard``) replace a pool-owned ``.grad`` by its copy after the first
    micro-step's backward: the record follows it, so micro-step 2 reuses the copy; any other new gradient
    object does not."""
    from opsmath.runtime.fp8_weights import WeightCasts
    casts = WeightCasts()
    w = nn.Parameter(torch.randn(32, 16))
    q, _ = casts.inputs_for([w])
    (q.float().sum() * 0 + (w * w).sum()).backward()   # a backward accumulating into w.grad
    assert casts._copy(w).fresh(w)
    old, w.grad = w.grad, w.grad.clone()
    assert not casts._copy(w).fresh(w)
    casts.grad_replaced(w, old, w.grad)
    assert casts._copy(w).fresh(w)
    w.grad.zero_()                                     # zero_grad(set_to_none=False)
    assert not casts._copy(w).fresh(w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_accumulation_under_cuda_graphs_reuses_copies(monkeypatch):
    _, _, _, cached = _recast_against_reuse(monkeypatch, cuda_graphs=True)
    assert cached._opsmath.weight_casts.reused == 2 * 4


def test_weights_passed_anew_each_call_are_not_kept_alive(monkeypatch):
    """``torch.func.functional_call`` hands the graph new weight tensors every call: their copies (and
    launch tables) must not keep them, nor grow without bound."""
    import gc
    import weakref
    from torch.func import functional_call
    monkeypatch.setattr("opsmath.patterns.fp8_linear.MIN_DIM", 32)
    torch.manual_seed(0)
    model = opsmath.optimize(MLP().to(DEVICE), fp8="cached", inductor=False)
    x = torch.randn(4, 16, 64, device=DEVICE)
    refs = []
    for _ in range(4):
        params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
        with torch.autocast(DEVICE, torch.bfloat16):
            functional_call(model, params, (x,)).float().sum().backward()
        refs.append(weakref.ref(params["up.weight"]))
        del params
    gc.collect()
    assert all(r() is None for r in refs[:-1])
    assert len(model._opsmath.weight_casts._copies) <= 2 * 2   # this call's weights, at most the last two


def test_cached_copies_under_a_memory_budget_plan_and_train_as_casting_every_forward(monkeypatch):
    """The recompute planner costs the FP8 op with its two extra inputs, and the copies do not change
    what the plan keeps: losses equal those of casting in the graph, op by op."""
    from opsmath import examples
    monkeypatch.setattr("opsmath.patterns.fp8_linear.MIN_DIM", 32)
    monkeypatch.setattr("opsmath.patterns.fp8_linear.SHARED_MIN_DIM", 32)
    torch.manual_seed(0)
    model, (x, y) = examples.llama(batch_size=2, seq_len=64)
    losses = {}
    for fp8 in (True, "cached"):
        torch._dynamo.reset()
        opt_model = opsmath.optimize(copy.deepcopy(model), fp8=fp8, memory_budget=0.6, inductor=False)
        opt = torch.optim.AdamW(opt_model.parameters(), lr=1e-3)
        losses[fp8] = []
        for _ in range(2):
            for _ in range(2):
                with torch.autocast("cpu", torch.bfloat16):
                    loss = opt_model(x, y)
                loss.backward()
                losses[fp8].append(loss.detach())
            opt.step()
            opt.zero_grad()
        assert opsmath.report(opt_model).graphs[0].plan is not None
    assert torch.equal(torch.stack(losses[True]), torch.stack(losses["cached"]))
    casts = opt_model._opsmath.weight_casts
    assert casts.casts == casts.reused > 0          # one cast and one reuse per weight and step


def test_a_weight_whose_data_changes_shape_gets_a_new_copy():
    from opsmath.runtime.fp8_weights import WeightCasts
    casts = WeightCasts()
    w = nn.Parameter(torch.randn(32, 16))
    assert casts.inputs_for([w])[0].shape == (32, 16)
    w.data = torch.randn(48, 16)
    q, s = casts.inputs_for([w])
    assert q.shape == (48, 16) and torch.equal(_bits(q), _bits(quantize(w.detach().bfloat16(), E4M3)[0]))
