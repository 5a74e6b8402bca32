"""Changing sequence lengths: after the second length a size becomes symbolic (as under torch.compile)
and one rewritten graph serves every later length; nothing runs unoptimized behind the user's back,
and training equals eager at every length."""
import copy

import pytest
import torch

import opsmath
from opsmath import examples
from conftest import DEVICE
from tolerance import grads_close, rel_err

LENGTHS = [8, 12, 16, 20, 24, 28, 30, 10, 14, 9, 31, 8]


def _train_all_lengths(model, eager, make_batch, **options):
    opt = opsmath.optimize(model, **options)
    for T in LENGTHS:
        batch = make_batch(T)
        loss, loss_e = opt(*batch[0], **batch[1]), eager(*batch[0], **batch[1])
        loss, loss_e = getattr(loss, "loss", loss), getattr(loss_e, "loss", loss_e)
        loss.backward()
        loss_e.backward()
        assert rel_err(loss, loss_e) < 1e-5, T
        for (name, p), pe in zip(opt.named_parameters(), eager.parameters()):
            if pe.grad is not None:
                assert grads_close(p.grad, pe.grad, 2e-3, atol=1e-6), (T, name)
        opt.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    return opsmath.report(opt)


def test_hf_llama_sdpa_one_dynamic_graph_for_every_length():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg).to(DEVICE)

    def batch(T):
        ids = torch.randint(0, 100, (2, T), device=DEVICE)
        return (), dict(input_ids=ids, labels=ids)
    rep = _train_all_lengths(model, copy.deepcopy(model), batch)
    assert [g.dynamic for g in rep.graphs] == [False, True], [(g.dynamic, g.calls, g.input_shapes) for g in rep.graphs]
    assert rep.graphs[1].calls == len(LENGTHS) - 1
    assert all(sum(m.pattern == "attention" for m in g.matches) == 2 for g in rep.graphs)
    assert rep.unoptimized_calls == 0
    assert "dynamic" in str(rep)


def test_nanogpt_constant_mask_and_every_length():
    torch.manual_seed(0)
    model, (idx, tgt) = examples.gpt(batch_size=2, seq_len=32, dropout=0.0)
    rep = _train_all_lengths(model, copy.deepcopy(model), lambda T: ((idx[:, :T].contiguous(), tgt[:, :T].contiguous()), {}))
    assert len(rep.graphs) == 2 and rep.graphs[1].dynamic and rep.unoptimized_calls == 0
    assert sum(m.pattern == "attention" for m in rep.graphs[1].matches) == 2


def test_memory_budget_plans_every_length_exactly():
    """Under a memory budget each length gets its own, exactly planned graph (up to opsmath's
    recompile limit, past dynamo's default of 8), none unoptimized."""
    torch.manual_seed(0)
    model, (idx, tgt) = examples.gpt(batch_size=2, seq_len=32, dropout=0.0)
    rep = _train_all_lengths(model, copy.deepcopy(model), lambda T: ((idx[:, :T].contiguous(), tgt[:, :T].contiguous()), {}),
                             memory_budget=0.9)
    assert len(rep.graphs) == len(set(LENGTHS)) and not any(g.dynamic for g in rep.graphs)
    assert rep.unoptimized_calls == 0
