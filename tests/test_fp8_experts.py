"""FP8 experts: the rowwise FP8 grouped GEMM against the same quantization in fp32 and against the exact
products (odd group sizes, an empty group, rows past the last group), and ``optimize(fp8=True)`` running
mixture-of-experts layers' grouped GEMMs in FP8 under both recipes, Hugging Face's default experts too."""
import copy
import os

import pytest
import torch

import opsmath
from opsmath import examples
from opsmath.kernels.fp8_grouped_mm import fp8_grouped_mm, reference
from opsmath.kernels.fp8_linear import E4M3, quantize
from tolerance import rel_err

DEVICE = os.environ.get("OPSMATH_TEST_DEVICE", "cpu")


def _fp8_at_any_size(monkeypatch):
    """FP8 for the small grouped GEMMs of test models too (measured slower than bf16 there), to test its path."""
    monkeypatch.setattr("opsmath.patterns.fp8_experts.fp8_pays", lambda S, G, K, N: True)


def _per_group(a, b, offs):
    """fp32 ``a[rows of g] @ b[g]`` per group, zeros past the last group."""
    out, start = torch.zeros(a.shape[0], b.shape[2], device=a.device), 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end].float() @ b[g].float()
        start = end
    return out


def test_fp8_grouped_mm_matches_its_quantized_reference_and_every_gradient():
    """Forward against the same quantization in fp32; the input gradient against its GEMM from the
    forward's e4m3 weights and dy with their scales folded in, quantized per row; the weight gradient
    against the bf16 products."""
    torch.manual_seed(0)
    x = torch.randn(37, 32, dtype=torch.bfloat16, device=DEVICE)
    x[4] *= 100                                                  # an outlier row: its own scale
    x.requires_grad_()
    w = (torch.randn(3, 32, 48, device=DEVICE) / 8).to(torch.bfloat16).requires_grad_()
    offs = torch.tensor([10, 10, 30], dtype=torch.int32, device=DEVICE)   # an empty expert, 7 rows past the end
    y = fp8_grouped_mm(x, w, offs)
    assert y.dtype == torch.bfloat16 and y.shape == (37, 48)
    assert rel_err(y[:30].float(), reference(x, w, offs)[:30].to(DEVICE)) < 1e-2
    exact = _per_group(x, w, offs)
    assert 1e-3 < rel_err(y[:30].float(), exact[:30]) < 6e-2                # FP8's own error
    dy = torch.randn(37, 48, device=DEVICE).to(torch.bfloat16)
    dy[30:] = 0                                                  # callers mask rows past the end
    y.backward(dy)
    wq, sw = quantize(w.detach().transpose(1, 2), E4M3, -1)                   # [G, N, K], [G, N, 1]
    groups = torch.tensor([0] * 10 + [2] * 27, device=DEVICE)                  # rows past the end: the last
    gq, sg = quantize(dy.float() * sw[groups, :, 0], E4M3, -1)
    dx_quantized = _per_group(gq.float() * sg, wq.float(), offs)
    assert rel_err(x.grad[:30].float(), dx_quantized[:30]) < 1e-2
    assert rel_err(x.grad[:30].float(), _per_group(dy, w.detach().transpose(1, 2), offs)[:30]) < 6e-2
    for g, (s, e) in enumerate([(0, 10), (10, 10), (10, 30)]):
        want = x.detach()[s:e].float().t() @ dy[s:e].float()
        assert w.grad[g].dtype == torch.bfloat16 and rel_err(w.grad[g].float(), want) < 1e-2, g


def test_a_linear_stacks_weight_gradient_arrives_in_its_layout():
    """Weights stored as ``nn.Linear`` stacks ([G, N, K], read transposed): the bf16 weight gradient
    reaches the parameter in its own layout (no transposing copy of every expert's gradient)."""
    torch.manual_seed(0)
    w = (torch.randn(2, 32, 16, device=DEVICE) / 4).to(torch.bfloat16).requires_grad_()
    x = torch.randn(20, 16, dtype=torch.bfloat16, device=DEVICE)
    offs = torch.tensor([7, 20], dtype=torch.int32, device=DEVICE)
    arrived = []
    w.register_hook(lambda g: arrived.append(g.stride()))
    dy = torch.randn(20, 32, device=DEVICE).to(torch.bfloat16)
    fp8_grouped_mm(x, w.transpose(1, 2), offs).backward(dy)
    assert arrived == [w.stride()]
    for g, (s, e) in enumerate([(0, 7), (7, 20)]):
        assert rel_err(w.grad[g].float(), dy[s:e].float().t() @ x[s:e].float()) < 1e-2, g


def test_fp8_grouped_mm_needs_sizes_in_multiples_of_16():
    x, w = torch.randn(8, 24, dtype=torch.bfloat16), torch.randn(2, 24, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_grouped_mm(x, w, torch.tensor([4, 8], dtype=torch.int32))


def _train(recipe: str, make, batch_of, fp8=True):
    """One step of ``make()`` in fp32 (the reference), in the recipe eagerly, and optimized: losses,
    each parameter's gradient error against the reference (eager's, opsmath's), the report."""
    torch.manual_seed(0)
    model = make()
    ref, batch = copy.deepcopy(model), batch_of(model)
    model = model.to(torch.bfloat16) if recipe == "bf16" else model
    eager, opt = copy.deepcopy(model), opsmath.optimize(copy.deepcopy(model), fp8=fp8)
    ref(**batch).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe == "amp"):
        le, lo = eager(**batch), opt(**batch)
    le.backward()
    lo.backward()
    errs = {n: (rel_err(p.grad.float(), r.grad), rel_err(q.grad.float(), r.grad))
            for (n, r), p, q in zip(ref.named_parameters(), eager.parameters(), opt.parameters()) if r.grad is not None}
    return le, lo, errs, opsmath.report(opt)


def _moe():
    return examples.moe(dim=64, hidden=128, n_expert=4)[0]


def _moe_batch(model):
    tok = torch.randint(0, model.tok_embeddings.num_embeddings, (4, 64), generator=torch.Generator().manual_seed(1))
    return dict(tokens=tok, targets=torch.roll(tok, -1, dims=1))


@pytest.mark.parametrize("recipe", ["bf16", "amp"])
def test_optimize_fp8_runs_rewritten_expert_loops_in_fp8(monkeypatch, recipe):
    """Both recipes: every grouped GEMM of every layer FP8; the loss within FP8's error of eager's, every
    gradient within FP8's error of the fp32 one: e4m3 rounds each operand by up to 6%, and an input gradient
    passes two FP8 GEMMs per layer (measured up to 0.10 beyond eager's own error, on a norm weight)."""
    _fp8_at_any_size(monkeypatch)
    le, lo, errs, rep = _train(recipe, _moe, _moe_batch)
    assert sum(m.pattern == "fp8_experts" for m in rep.matches) == 3 * sum(m.pattern == "experts" for m in rep.matches)
    assert rel_err(lo.detach().float(), le.detach().float()) < 1e-2
    for name, (e_eager, e_opt) in errs.items():
        assert e_opt <= e_eager + 0.15, (name, e_eager, e_opt)


def _mixtral():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                                        num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def _lm_batch(model):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, labels=ids)


class _Loss(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, **batch):
        return self.net(**batch).loss


@pytest.mark.parametrize("recipe", ["bf16", "amp"])
def test_hugging_face_default_experts_run_fp8(monkeypatch, recipe):
    """Mixtral's default grouped experts: ``torch._grouped_mm`` with bf16 weights; with fp32 weights under
    autocast the library's fp32 fallback (swapped for opsmath's grouped op), which FP8 takes by default."""
    _fp8_at_any_size(monkeypatch)
    le, lo, errs, rep = _train(recipe, lambda: _Loss(_mixtral()), _lm_batch)
    fp8 = [m for m in rep.matches if m.pattern == "fp8_experts"]
    assert len(fp8) == 2 * 2, [(d.pattern, d.reason) for d in rep.declines]    # gate_up and down, 2 layers
    swapped = [m.replacement for m in rep.matches if m.pattern == "experts"]
    assert all("autocast does not reach" in r for r in swapped) and bool(swapped) == (recipe == "amp")
    assert rel_err(lo.detach().float(), le.detach().float()) < 1e-2
    assert all(e_opt <= e_eager + 0.15 for e_eager, e_opt in errs.values()), errs


def test_fp8_experts_are_opt_in_and_small_bf16_grouped_gemms_stay_bf16_with_the_reason():
    _, _, _, plain = _train("bf16", _moe, _moe_batch, fp8=False)
    assert not [m for m in plain.matches if m.pattern == "fp8_experts"]
    _, _, _, bf16 = _train("amp", _moe, _moe_batch)     # the loop's GEMMs run bf16 under autocast
    assert not [m for m in bf16.matches if m.pattern == "fp8_experts"]
    assert any("measured" in d.reason and "stays bf16" in d.reason for d in bf16.declines if d.pattern == "fp8_experts")


def test_small_fp32_expert_gemms_under_autocast_run_bf16():
    """HF Mixtral's fp32 fallback under autocast, where FP8 does not pay: a bf16 grouped GEMM, autocast's
    dtype; outputs fp32 as eager's; loss and gradients within bf16's error of eager (which runs them fp32)."""
    le, lo, errs, rep = _train("amp", lambda: _Loss(_mixtral()), _lm_batch)
    mine = [m for m in rep.matches if m.pattern == "fp8_experts"]
    assert len(mine) == 2 * 2 and all("bf16 grouped GEMM" in m.replacement for m in mine), mine
    assert lo.dtype == le.dtype and rel_err(lo.detach().float(), le.detach().float()) < 1e-2
    assert all(e_opt <= e_eager + 0.05 for e_eager, e_opt in errs.values()), errs


def test_the_pricing_rule_agrees_with_the_committed_measurement():
    """``fp8_pays`` against ``benchmarks/grouped_gemm.py``'s H200 run (static shapes, kernel time): FP8
    where it measured at least 1.1x bf16, bf16 where it measured below 1.07x."""
    import json
    import pathlib
    from opsmath.patterns.fp8_experts import fp8_pays
    path = pathlib.Path(__file__).parents[1] / "benchmarks/results/grouped-gemm-fp8-static-h200-20261204.json"
    rows = [r for r in json.loads(path.read_text())["rows"] if "error" not in r]
    assert len(rows) >= 8
    for r in rows:
        if r["fp8_gpu_speedup"] >= 1.1 or r["fp8_gpu_speedup"] < 1.07:
            assert fp8_pays(r["S"], r["G"], r["K"], r["N"]) == (r["fp8_gpu_speedup"] >= 1.1), r["shape"]


def test_autocast_is_read_from_the_capture_when_no_gemm_shows_it():
    """A graph piece holding only an MoE layer's experts (PhiMoE splits so) shows autocast by no GEMM:
    the capture's autocast state says it. A graph with autocast regions of its own is read from its GEMMs,
    and a node inside a region turning autocast off is not under it."""
    import torch.fx as fx
    from opsmath.rewrite.canonicalize import under_bf16_autocast
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4, 16)
    relu = g.call_function(torch.ops.aten.relu.default, (x,))
    g.output(relu)
    assert not under_bf16_autocast(g)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not under_bf16_autocast(g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert under_bf16_autocast(g) and under_bf16_autocast(g, relu)
        w = g.placeholder("w")
        w.meta["val"] = torch.randn(8, 16)
        with g.inserting_before(relu):
            lin = g.call_function(torch.ops.aten.linear.default, (x, w))
            lin.meta["val"] = torch.randn(4, 8, dtype=torch.bfloat16)       # what autocast makes of it
            off = g.call_function(torch.amp.autocast_mode._enter_autocast, ("cpu", None, False, None))
        with g.inserting_after(relu):
            g.call_function(torch.amp.autocast_mode._exit_autocast, (off,))
        assert under_bf16_autocast(g, lin) and not under_bf16_autocast(g, relu)
    assert under_bf16_autocast(g)                       # the GEMM shows it, captured or not


def test_the_bf16_expert_gemm_keeps_the_parameter_for_backward_under_inductor():
    """Under Inductor (its partitioner), backward keeps the fp32 expert weights, parameters resident
    anyway, and no bf16 copy of them: the cast is tagged for recompute (untagged, Inductor saved the copies)."""
    m = _mixtral()
    opt = opsmath.optimize(m, fp8=True, inductor=True)
    batch, saved = _lm_batch(m), []
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = opt(**batch).loss
    params = {p.data_ptr() for p in m.parameters()}
    experts = [t for t in saved if t.dim() == 3 and t.shape[0] == 4]
    assert experts and all(t.dtype == torch.float32 and t.data_ptr() in params for t in experts), \
        [(tuple(t.shape), t.dtype) for t in experts]
    loss.backward()
    assert all("bf16 grouped GEMM" in r.replacement for r in opsmath.report(opt).matches if r.pattern == "fp8_experts")
