"""No silent skips: a subgraph that looks like a family's candidate but is not rewritten gets a declined row
(``unmatched.py``), and the spellings the rules read get none."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opsmath

C = 32


class Residual(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.f, self.norm, self.g = nn.Linear(C, C), norm, nn.Parameter(torch.rand(C) + 0.5)

    def forward(self, x):
        h = x + self.f(x)
        return self.norm(self, h).pow(2).mean()


def unclamped_norm(m, h):   # h / ||h|| * sqrt(d) * g: F.normalize without its eps clamp, no rule reads it
    return h / torch.linalg.vector_norm(h, dim=-1, keepdim=True) * math.sqrt(C) * m.g


def norm_of_reshaped_sum(m, h):   # a windowed vision model's LayerNorm over a reshape of the residual sum
    return F.layer_norm(h.reshape(-1, 4, C), (C,), m.g)


def stable_cross_entropy(m, h):   # a training wrapper's own loss
    logp = F.log_softmax(h, dim=-1)
    target = torch.zeros(h.shape[:-1], dtype=torch.long)
    return -logp.gather(-1, target.unsqueeze(-1))


@pytest.mark.parametrize("norm,family", [(unclamped_norm, "dropout_add_norm"), (norm_of_reshaped_sum, "dropout_add_norm"),
                                         (stable_cross_entropy, "cross_entropy")])
def test_unrecognized_candidates_are_declined_rows(norm, family):
    torch.manual_seed(0)
    model = Residual(norm)
    eager, opt = copy.deepcopy(model), opsmath.optimize(model)
    x = torch.randn(2, 8, C)
    torch.testing.assert_close(opt(x), eager(x))
    rep = opsmath.report(opt)
    assert any(d.pattern == family and d.reason.startswith("not recognized") for d in rep.declines), rep.declines


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_recognized_spellings_get_no_unrecognized_row(arch):
    torch.manual_seed(0)
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **small)) if arch == "llama" \
        else transformers.BertForMaskedLM(transformers.BertConfig(**small))
    opt = opsmath.optimize(model)
    ids = torch.randint(0, 128, (2, 16))
    opt(input_ids=ids, labels=ids).loss.backward()
    rep = opsmath.report(opt)
    assert not [d for d in rep.declines if d.reason.startswith("not recognized")], rep.declines
    assert rep.count("attention") == 2 and rep.count("dropout_add_norm") == 4
