"""Log calls in model code that are no graph break under ``optimize``: Hugging Face's ``loss_function``, which
logs on each access where the config names no known loss type (read once before capture: the loss stays in
the model's graph, the LM head fused with it), and, from torch 2.14, ``logger.warning_once`` anywhere in
``forward`` (run after the graph). Each prints its message once, and the step equals eager's."""
import copy
import logging
import re

import pytest
import torch
from torch import nn

import opsmath

transformers = pytest.importorskip("transformers")
logger = transformers.utils.logging.get_logger("opsmath.tests.warning_once")
REORDERS = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 14)


def _messages(log: logging.Logger, steps):
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log.addHandler(handler)
    try:
        steps()
    finally:
        log.removeHandler(handler)
    return seen


def _one_graph_equal_grads(opt, ref):
    rep = opsmath.report(opt)
    assert len(rep.graphs) == 1 and not [e for e in rep.eager_regions if e.kind == "graph break"]
    for a, b in zip(opt.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    return rep


def test_hf_loss_function_is_read_once_and_the_loss_stays_in_the_graph():
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).train()   # not *ForCausalLM: its loss_type is unrecognized
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 16))

    def steps():
        opt = opsmath.optimize(model)
        for _ in range(2):
            opt(input_ids=ids, labels=ids).loss.backward()
            ref(input_ids=ids, labels=ids).loss.backward()
    seen = _messages(transformers.modeling_utils.logger, steps)
    assert len([m for m in seen if "loss_type" in m]) <= 1   # once at most (warning_once: once per process)
    rep = _one_graph_equal_grads(model, ref)
    assert rep.count("linear_cross_entropy") == 1   # the LM head and its loss, fused


class WarnsInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(16, 32), nn.Linear(32, 10)

    def forward(self, x, y):
        h = torch.relu(self.proj(x))
        logger.warning_once("a one-time message from forward")
        return nn.functional.cross_entropy(self.head(h), y)


@pytest.mark.skipif(not REORDERS, reason="dynamo reorders logging.Logger methods from torch 2.14 on")
def test_warning_once_in_forward_runs_after_the_graph():
    torch.manual_seed(0)
    model = WarnsInForward()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    opt = opsmath.optimize(model)

    def steps():
        for _ in range(2):
            opt(x, y).backward()
            ref(x, y).backward()
    assert _messages(logger, steps) == ["a one-time message from forward"]   # once, as eager
    _one_graph_equal_grads(opt, ref)
