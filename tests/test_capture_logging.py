"""A one-time log call in model code (Hugging Face's ``logger.warning_once``, which its ``loss_function`` and many
``forward``s call) is no graph break under ``optimize``: one graph, the loss inside it, the message still
printed once, the step equal to eager's."""
import copy
import logging

import pytest
import torch
from torch import nn

import opsmath

hf_logging = pytest.importorskip("transformers.utils.logging")
logger = hf_logging.get_logger("opsmath.tests.warning_once")


class WarnsInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(16, 32), nn.Linear(32, 10)

    def forward(self, x, y):
        h = torch.relu(self.proj(x))
        logger.warning_once("`loss_type=None` was set in the config but it is unrecognized.")
        return nn.functional.cross_entropy(self.head(h), y)


def test_warning_once_runs_after_the_graph_not_as_a_break(capsys):
    torch.manual_seed(0)
    model = WarnsInForward()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    opt = opsmath.optimize(model)
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        for _ in range(2):
            opt(x, y).backward()
            ref(x, y).backward()
    finally:
        logger.removeHandler(handler)
    rep = opsmath.report(opt)
    assert len(rep.graphs) == 1 and not [e for e in rep.eager_regions if e.kind == "graph break"]
    assert seen == ["`loss_type=None` was set in the config but it is unrecognized."]   # once, as eager
    for a, b in zip(opt.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
