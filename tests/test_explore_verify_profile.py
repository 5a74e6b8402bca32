"""opsmath.explore / verify / profile on CPU."""
import copy

import pytest
import torch

import opsmath
from opsmath import examples


@pytest.fixture
def gpt_pair():
    torch.manual_seed(0)
    model, batch = examples.gpt(batch_size=2, seq_len=16)
    return model, batch


def test_verify_passes_and_tracks_loss_curve(gpt_pair):
    model, batch = gpt_pair
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    res = opsmath.verify(eager, opt, *batch, steps=5)
    assert res.ok and res.verdict == "PASS"
    assert len(res.checks) == 1 + len(list(eager.parameters()))  # the output and every gradient
    assert res.max_loss_rel_diff < 1e-5 and len(res.losses["opsmath"]) == 5
    assert "verdict: PASS" in str(res) and "verdict" in res._repr_html_()
    # training inside verify leaves the caller's weights untouched
    assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), model.parameters()))


def test_verify_catches_a_wrong_model(gpt_pair):
    model, batch = gpt_pair
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    with torch.no_grad():
        opt.ln_f.weight.mul_(1.01)   # a real numerical difference
    res = opsmath.verify(eager, opt, *batch)
    assert not res.ok and "FAIL" in res.verdict


def test_verify_needs_two_objects(gpt_pair):
    model, batch = gpt_pair
    with pytest.raises(ValueError, match="deepcopy"):
        opsmath.verify(model, model, *batch)


def test_explore_skip_emit_compare(gpt_pair):
    model, batch = gpt_pair
    ex = opsmath.explore(model, *batch)
    assert [c.pattern for c in ex.candidates].count("attention") == 2
    assert not hasattr(model, "_opsmath")   # exploring leaves the model alone
    ex.skip(0)
    emitted = ex.emit()
    emitted(*batch)
    rep = opsmath.report(emitted)
    assert rep.count("attention") == 1
    assert [d.reason for d in rep.declines] == ["skipped by the user"]
    assert ex.compare(emitted).ok
    ex.only("dropout_add_norm")
    assert all(c.enabled == (c.pattern == "dropout_add_norm") for c in ex.candidates)
    assert "candidates" in str(ex)


def test_explore_draw(gpt_pair):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    model, batch = gpt_pair
    ex = opsmath.explore(model, *batch)
    ax = ex.draw(0)
    drawn = {t.get_text() for t in ax.texts}
    assert {"softmax.int", "matmul"} <= drawn
    import matplotlib.pyplot as plt
    _, ax2 = plt.subplots()
    whole = {t.get_text() for t in ex.draw(graph=0, ax=ax2).texts}   # the whole graph around candidate 0
    assert drawn < whole and "embedding" in whole


def test_profile_counts_fewer_ops(gpt_pair):
    model, batch = gpt_pair
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    res = opsmath.profile(eager, opt, *batch, steps=2)
    eager_row, ops_row = res.rows
    assert res.device == "cpu" and ops_row.launches_per_step < eager_row.launches_per_step
    assert "opsmath.profile" in str(res)
