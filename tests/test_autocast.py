"""Mixed precision as people train: fp32 weights under ``torch.autocast`` (bf16) get every rewrite that
bf16 weights get, and train as eager under the same autocast does, by the tolerance rule: against an fp32
run of the same model without autocast (fp64 where every op takes it would change nothing: the bf16 error
dwarfs fp32's; HF's grouped experts take no fp64), each gradient's error (in norm) is at most twice eager-autocast's plus 1% of its
norm. The rewritten ops take the dtypes autocast gives the ops they replace (``RewriteContext.cast``)."""
import copy
from collections import Counter

import pytest
import torch

import opsmath
from opsmath import examples
from tolerance import rel_err

transformers = pytest.importorskip("transformers")

SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=128)


def _hf(cls, cfg, **kw):
    return getattr(transformers, cls)(getattr(transformers, cfg)(**SMALL, **kw))   # default attention (SDPA)


MODELS = {
    "llama": lambda: _hf("LlamaForCausalLM", "LlamaConfig"),
    "mistral": lambda: _hf("MistralForCausalLM", "MistralConfig", sliding_window=8),
    "mixtral": lambda: _hf("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
    "moe_loop": lambda: examples.moe(batch_size=2, seq_len=16)[0],
}


def _loss(model, ids):
    if not isinstance(model, transformers.PreTrainedModel):
        return model(ids, torch.roll(ids, -1, dims=1))
    return model(input_ids=ids, labels=ids).loss


def _step(model, ids, amp):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = _loss(model, ids)
    loss.backward()
    return loss.detach()


def _rewrites(model) -> Counter:
    return Counter(m.pattern for m in opsmath.report(model).matches)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fp32_weights_under_autocast_get_the_bf16_rewrites_and_train_as_eager(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    ids = torch.randint(0, 128, (2, 16))
    bf16 = opsmath.optimize(copy.deepcopy(model).to(torch.bfloat16))
    _step(bf16, ids, amp=False)
    torch._dynamo.reset()
    ref, eager, opt = copy.deepcopy(model), copy.deepcopy(model), opsmath.optimize(copy.deepcopy(model))
    l_ref, l_eager, l_opt = _step(ref, ids, False), _step(eager, ids, True), _step(opt, ids, True)
    amp_rewrites = _rewrites(opt)
    if name == "mixtral":   # fp32 experts take the library's per-expert fallback op, swapped (_experts_library)
        assert amp_rewrites.pop("experts") == 4
    assert amp_rewrites == _rewrites(bf16), [d.reason for d in opsmath.report(opt).declines]
    assert _rewrites(opt)["attention"] == 2
    assert l_opt.dtype == l_eager.dtype
    assert abs(l_opt.double() - l_ref) <= 2 * abs(l_eager.double() - l_ref) + 1e-2 * abs(l_ref)
    for (n, p_opt), p_eager, p_ref in zip(opt.named_parameters(), eager.parameters(), ref.parameters()):
        if p_ref.grad is None:
            assert p_opt.grad is None and p_eager.grad is None, n
            continue
        assert rel_err(p_opt.grad, p_ref.grad) <= 2 * rel_err(p_eager.grad, p_ref.grad) + 1e-2, n


def test_experts_under_autocast_run_the_grouped_gemm_in_bf16():
    """A routing loop over fp32 experts under bf16 autocast: the grouped GEMMs take bf16 operands, as the
    per-expert linears do under autocast (``torch._grouped_mm``, not the per-group fp32 path)."""
    torch.manual_seed(0)
    opt = opsmath.optimize(MODELS["moe_loop"]())
    _step(opt, torch.randint(0, 128, (2, 16)), amp=True)
    experts = [m for m in opsmath.report(opt).matches if m.pattern == "experts"]
    assert experts and all(g == "torch._grouped_mm" for m in experts for g in m.details["gemms"])


def test_float64_loss_head_declines_the_fp32_fused_loss():
    torch.manual_seed(0)
    model, batch = examples.gpt(batch_size=2, seq_len=16, dropout=0.0)
    model = model.double()
    eager, opt = copy.deepcopy(model), opsmath.optimize(model)
    torch.testing.assert_close(opt(*batch), eager(*batch), rtol=1e-12, atol=0)
    rep = opsmath.report(opt)
    assert not any(m.pattern in ("linear_cross_entropy", "cross_entropy") for m in rep.matches)
    assert any("float64" in d.reason for d in rep.declines if d.pattern == "linear_cross_entropy")


def _accelerate_wrapped(model):
    """What ``Accelerator(mixed_precision="bf16").prepare(model)`` does (HF ``Trainer(bf16=True)``): the
    instance's ``forward`` runs under autocast, its outputs converted to fp32."""
    accelerate = pytest.importorskip("accelerate")
    return accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare_model(model)


def test_autocast_entered_inside_forward_as_accelerate_does():
    """Accelerate wraps ``model.forward`` in autocast, so the region is inside the captured graph: it is
    hoisted around the graph, which then gets the rewrites and the training of autocast around the call."""
    torch.manual_seed(0)
    model, ids = MODELS["llama"](), torch.randint(0, 128, (2, 16))
    ref, eager = copy.deepcopy(model), _accelerate_wrapped(copy.deepcopy(model))
    around = opsmath.optimize(copy.deepcopy(model))
    _step(around, ids, amp=True)
    opt = _accelerate_wrapped(opsmath.optimize(copy.deepcopy(model)))
    l_ref, l_eager, l_opt = _step(ref, ids, False), _step(eager, ids, False), _step(opt, ids, False)
    assert _rewrites(opt) == _rewrites(around) and _rewrites(opt)["attention"] == 2
    assert not any("autocast" in e for e in opt._opsmath.fallback_errors)
    assert abs(l_opt.double() - l_ref) <= 2 * abs(l_eager.double() - l_ref) + 1e-2 * abs(l_ref)
    for (n, p_opt), p_eager, p_ref in zip(opt.named_parameters(), eager.parameters(), ref.parameters()):
        assert rel_err(p_opt.grad, p_ref.grad) <= 2 * rel_err(p_eager.grad, p_ref.grad) + 1e-2, n


class HalfUnderAutocast(torch.nn.Module):
    """autocast entered for part of the forward only: the rules cannot see its casts."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.out = torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 32)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.inp(x)
        return self.out(self.norm(h + x)).float().sum()


def test_autocast_for_part_of_forward_leaves_the_graph_unrewritten_and_says_so():
    torch.manual_seed(0)
    model, x = HalfUnderAutocast(), torch.randn(4, 8, 32)
    eager, opt = copy.deepcopy(model), opsmath.optimize(copy.deepcopy(model))
    torch.testing.assert_close(opt(x), eager(x))
    opt(x).backward(), eager(x).backward()
    for p_opt, p_eager in zip(opt.parameters(), eager.parameters()):
        torch.testing.assert_close(p_opt.grad, p_eager.grad)
    rep = opsmath.report(opt)
    assert not rep.matches
    assert any("autocast is entered inside" in e for e in opt._opsmath.fallback_errors)
