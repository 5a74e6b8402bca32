"""Model code written outside this project (``models_in_the_wild.py``) trains under ``opsmath.optimize`` as
it does eagerly, and the report says what was rewritten and what ran as written: the families each model
should get, and for the two that dynamo cannot capture whole (an ``nn.GRU`` skips its frame; ``nn.Transformer``
breaks the graph in its causal-mask check) the place of each break. And PEFT's LoRA fine-tuning of HF LLaMA."""
import copy

import pytest
import torch

import opsmath
from models_in_the_wild import CASES
from test_semantics import MODES, assert_trains_like_eager

REWRITES = {"meta_llama": {"attention", "swiglu"}, "einops_vit": {"attention"}, "dit": {"attention"},
            "palm": {"attention"}, "switch_moe": {"experts"}, "ssm_scan": set(), "gru_pool": set(),
            "nn_transformer": set()}


def _make(name):
    def make():
        cls, inputs = CASES[name]
        g = torch.Generator().manual_seed(0)
        return cls(), [inputs(g) for _ in range(3)]
    return make


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_trains_like_eager_with_the_rewrites_it_should_get(name):
    """fp32 on CPU (the fused ops' rounding: 1e-4 in norm); on a GPU, bf16 beside an fp32 reference."""
    optimized = assert_trains_like_eager(_make(name), patterns=None, mode=MODES[True])
    rep = opsmath.report(optimized)
    got = {m.pattern for m in rep.matches}
    assert REWRITES[name] <= got, rep.render(width=140)
    breaks = [r for r in rep.eager_regions if r.kind == "graph break"]
    if name == "gru_pool":
        assert not rep.graphs and breaks and breaks[0].location.startswith("models_in_the_wild.py:")
    if name == "nn_transformer":
        assert any(r.location.startswith("torch/nn/modules/transformer.py:") for r in breaks), breaks


@pytest.mark.slow
def test_peft_lora_fine_tuning_trains_like_eager_and_merges():
    """PEFT's LoRA on HF LLaMA (adapters on q, v and gate projections; the base frozen): three AdamW steps
    equal eager's, only the adapters get gradients, and ``merge_and_unload`` afterwards gives eager's model."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from tolerance import rel_err
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    steps = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, eager)]
    for _ in range(3):
        ids = torch.randint(0, 100, (2, 12))
        lo, le = opt(input_ids=ids, labels=ids).loss, eager(input_ids=ids, labels=ids).loss
        lo.backward()
        le.backward()
        assert rel_err(lo.detach(), le.detach()) < 1e-5
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None) == (not q.requires_grad), name
            assert p.grad is None or rel_err(p.grad, q.grad) < 1e-4, name
        for s in steps:
            s.step()
            s.zero_grad()
    assert {m.pattern for m in opsmath.report(opt).matches} >= {"attention", "swiglu"}
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        merged, reference = model.merge_and_unload(), eager.merge_and_unload()
        assert rel_err(merged(input_ids=ids).logits, reference(input_ids=ids).logits) < 1e-5
