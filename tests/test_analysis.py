"""Predicted saved-activation bytes against what autograd really saves (saved_tensors_hooks on the
eager model), deduplicated by storage; parameters, buffers and inputs excluded."""
import copy

import pytest
import torch

import opsmath
from opsmath import examples


def _measured_saved_bytes(model, batch) -> int:
    skip = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers(), *batch]}
    saved = {}

    def pack(t):
        k = t.untyped_storage()._cdata
        if k not in skip:
            saved.setdefault(k, t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*batch)
    return sum(saved.values())


@pytest.mark.parametrize("factory,dropout", [(examples.gpt, 0.0), (examples.gpt, 0.1), (examples.llama, None)])
def test_predicted_saved_bytes_equal_measured(factory, dropout):
    torch.manual_seed(0)
    kw = {} if dropout is None else {"dropout": dropout}
    model, batch = factory(batch_size=2, seq_len=32, **kw)
    measured = _measured_saved_bytes(copy.deepcopy(model), batch)
    opt = opsmath.optimize(model)
    opt(*batch)
    g = opsmath.report(opt).graphs[0]
    assert g.saved_bytes[0] == measured
    assert g.saved_bytes[1] < g.saved_bytes[0]   # the fused ops keep less
    assert g.launches[1] < g.launches[0]


def test_fused_graph_prediction_matches_its_own_run():
    """After the rewrite, the prediction equals what the optimized model's autograd saves."""
    torch.manual_seed(0)
    model, batch = examples.gpt(batch_size=2, seq_len=32, dropout=0.1)
    opt = opsmath.optimize(model)
    opt(*batch)
    predicted = opsmath.report(opt).graphs[0].saved_bytes[1]
    assert _measured_saved_bytes(opt, batch) == predicted
