"""Sampling and evaluation inside a training run: ``generate()`` after ``optimize`` gives eager's tokens with
no capture per decoded length (no-grad calls at inputs no training call had run eagerly, counted in the
report), while an evaluation at the training batch's shapes is compiled once."""
import pytest
import torch

import opsmath

transformers = pytest.importorskip("transformers")


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=128, pad_token_id=0)
    model, ref = transformers.LlamaForCausalLM(cfg), transformers.LlamaForCausalLM(cfg)
    ref.load_state_dict(model.state_dict())
    return model, ref


def test_generate_after_training_runs_eagerly_with_eagers_tokens():
    model, ref = _llama()
    ids = torch.randint(1, 128, (2, 16))
    opt = opsmath.optimize(model)
    opt(input_ids=ids, labels=ids).loss.backward()
    opt.eval()
    ref.eval()
    mask = torch.ones_like(ids)
    got = opt.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(got, want)
    rep = opsmath.report(opt)
    assert len(rep.graphs) == 1 and rep.graphs[0].training        # nothing captured for the decoding
    assert rep.eager_inference_calls == 20
    assert "ran eagerly: no capture per shape" in str(rep)
    with torch.no_grad():   # an evaluation at the training batch's inputs is compiled
        loss = opt(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, ref(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)
    assert len(opsmath.report(opt).graphs) == 2 and opsmath.report(opt).eager_inference_calls == 20
