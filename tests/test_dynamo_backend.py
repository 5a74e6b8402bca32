"""``torch.compile(model, backend="opsmath")``: opsmath registered as a dynamo backend (entry point
``torch_dynamo_backends``), taking ``optimize``'s options, training equal to eager with the rewrites, and
reported by ``opsmath.report`` on the compiled module."""
import copy

import pytest
import torch

import opsmath
from opsmath.examples import gpt
from tolerance import rel_err


def _pair():
    torch.manual_seed(0)
    model, batch = gpt(dropout=0.0, n_layer=2, n_embd=64, n_head=4, vocab_size=128, seq_len=32, batch_size=2)
    return model, copy.deepcopy(model), batch


def test_backend_by_name_trains_as_eager_with_the_rewrites():
    model, eager, batch = _pair()
    compiled = torch.compile(model, backend="opsmath")
    for _ in range(2):
        lo, le = compiled(*batch), eager(*batch)
        lo.backward()
        le.backward()
        assert rel_err(lo.detach(), le.detach()) <= 1e-5
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-4, n
    rep = opsmath.report(compiled)
    assert sum(m.pattern == "attention" for m in rep.matches) == 2
    assert rep.graphs[0].calls == 2


def test_backend_options_are_optimize_options():
    model, _, batch = _pair()
    compiled = torch.compile(model, backend="opsmath", options={"skip": ["attention"]})
    compiled(*batch).backward()
    rep = opsmath.report(compiled)
    assert rep.matches and not any(m.pattern == "attention" for m in rep.matches)
    assert any(d.reason == "skipped by the user" for d in rep.declines)
    with pytest.raises(Exception, match="unknown options"):
        torch.compile(_pair()[0], backend="opsmath", options={"budget": 1})(*batch)
