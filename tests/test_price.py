"""Priced rewrites (``OPSMATH_PRICE=1``, ``rewrite/price.py``): on a graph Inductor compiles, an occurrence
of a family Inductor may fuse as well is kept only where opsmath's op measures faster. The GPU timing is
injected here (``price.MEASURE``); the graph surgery (cutting out both sides, putting the original back),
the cache and the report are real, and one test compiles both sides with Inductor on the CPU."""
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opsmath
from opsmath.rewrite import price
from opsmath.runtime import backend
from test_inductor import pair, step_equals_eager

PRICED = {"dropout_add_norm", "bias_gelu", "linear_cross_entropy", "cross_entropy", "swiglu", "scaled_softmax"}


@pytest.fixture
def priced(monkeypatch, tmp_path):
    """Pricing on, a private tuning cache, Inductor's compile of the whole graph replaced by running it op by
    op (the decisions are what is tested), both priced sides run eagerly unless a test compiles them, and
    a fake clock: ``times[candidate]`` ms, each measurement counted in ``calls``."""
    monkeypatch.setenv("OPSMATH_PRICE", "1")
    monkeypatch.setenv("OPSMATH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(backend, "compile_fx", lambda gm, example_inputs, **kw: gm)
    monkeypatch.setattr(price, "COMPILE", lambda gm, inputs: gm)
    monkeypatch.setattr(price, "saved_bytes", lambda forward: (forward(), 0)[1])   # equal: time decides
    from opsmath.kernels import autotune
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(price, "_VERDICTS", {})
    clock = {"times": {"inductor": 1.0, "opsmath": 2.0}, "calls": []}

    def measure(fn):
        fn()
        clock["calls"].append(fn.candidate)
        return clock["times"][fn.candidate]
    monkeypatch.setattr(price, "MEASURE", measure)
    return clock


def test_where_inductor_wins_the_original_ops_are_put_back(priced, monkeypatch):
    """Every priced occurrence of a GPT (dropout-add-norm, bias-GELU, the LM-head loss) measured slower
    than Inductor: none is rewritten, each is declined with both times, the step equals eager's."""
    ref, model, batch = pair(dropout=0.0)
    model = opsmath.optimize(model, inductor=True)
    step_equals_eager(model, ref, batch)
    rep = opsmath.report(model)
    assert not [m for m in rep.matches if m.pattern in PRICED]
    declined = [d for d in rep.declines if "Inductor's fusion" in d.reason]
    assert {d.pattern for d in declined} >= {"dropout_add_norm", "bias_gelu", "linear_cross_entropy"}
    assert all("inductor 1.000 ms, opsmath 2.000 ms" in d.reason for d in declined)
    assert not any(str(n.target).startswith(("opsmath.dropout_add", "opsmath.bias_gelu", "opsmath.linear_cross"))
                   for n in rep.graphs[0].graph.graph.nodes)
    # identical layers share one measurement per side
    assert priced["calls"].count("opsmath") < len(declined)
    # put back exactly: the same graph, node names included, as without pricing (the families left)
    monkeypatch.setenv("OPSMATH_PRICE", "0")
    ref, plain, batch = pair(dropout=0.0)
    plain = opsmath.optimize(plain, inductor=True)
    plain(*batch).backward()
    assert rep.graphs[0].after_code == opsmath.report(plain).graphs[0].after_code


def test_where_opsmath_wins_the_rewrite_stays_and_the_verdict_is_cached(priced):
    priced["times"] = {"inductor": 2.0, "opsmath": 1.0}
    ref, model, batch = pair(dropout=0.0)
    model = opsmath.optimize(model, inductor=True)
    step_equals_eager(model, ref, batch)
    kept = [m for m in opsmath.report(model).matches if m.pattern in PRICED]
    assert {m.pattern for m in kept} >= {"dropout_add_norm", "bias_gelu", "linear_cross_entropy"}
    assert all(m.details["priced"].startswith("inductor 2.000 ms, opsmath 1.000 ms; saved for backward")
               for m in kept)
    measured = len(priced["calls"])
    ref, again, batch = pair(dropout=0.0)
    again = opsmath.optimize(again, inductor=True)
    step_equals_eager(again, ref, batch)
    assert len(priced["calls"]) == measured        # read from the cache
    assert len([m for m in opsmath.report(again).matches if m.pattern in PRICED]) == len(kept)


def test_without_the_switch_the_families_are_left_to_inductor(priced, monkeypatch):
    monkeypatch.setenv("OPSMATH_PRICE", "0")
    ref, model, batch = pair(dropout=0.0)
    model = opsmath.optimize(model, inductor=True)
    step_equals_eager(model, ref, batch)
    assert not priced["calls"]
    assert set(opsmath.report(model).graphs[0].left_to_inductor) >= {"dropout_add_norm", "bias_gelu"}


def test_the_decision_weighs_time_and_bytes_saved_for_backward():
    """Kept where faster and saving no more; under a memory budget also where it saves less."""
    fast, slow = {"inductor": 2.0, "opsmath": 1.0}, {"inductor": 1.0, "opsmath": 2.0}
    more, less, same = {"inductor": 1, "opsmath": 2}, {"inductor": 2, "opsmath": 1}, {"inductor": 1, "opsmath": 1}
    assert price.judged("opsmath", fast, same, budget=False) is None
    assert price.judged("opsmath", fast, {}, budget=False) is None          # bytes unknown: time decides
    assert "saves more for backward" in price.judged("opsmath", fast, more, budget=False)
    assert "as fast or faster" in price.judged("inductor", slow, less, budget=False)
    assert price.judged("inductor", slow, less, budget=True) is None
    assert price.judged("opsmath", fast, more, budget=True) is not None
    assert price.judged("RuntimeError: x", {}, {}, budget=True).startswith("left to Inductor: measuring failed")


def test_saved_bytes_counts_each_storage_once():
    x = torch.randn(64, 64, requires_grad=True)
    assert price.saved_bytes(lambda: (x * x).sum()) == 64 * 64 * 4          # x saved twice, one storage
    assert price.saved_bytes(lambda: (x + 1).sum()) == 0


def test_off_the_gpu_nothing_is_priced(priced, monkeypatch):
    """Priced by GPU kernel time: a CPU graph under Inductor leaves the families to it, measuring nothing."""
    monkeypatch.setattr(price, "MEASURE", None)
    ref, model, batch = pair(dropout=0.0)
    model = opsmath.optimize(model, inductor=True)
    step_equals_eager(model, ref, batch)
    rep = opsmath.report(model)
    assert not [m for m in rep.matches if m.pattern in PRICED]
    assert any(d.reason.endswith("on CUDA only") for d in rep.declines)


class SwiGLU(nn.Module):
    def __init__(self, d=16, h=24):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x)).square().mean()


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor on CPU needs a C++ compiler")
def test_both_sides_compile_with_inductor_and_a_failure_leaves_the_original(priced, monkeypatch):
    """The priced sides compiled for real (Inductor's C++ on the CPU), forward and backward; then a
    compile that raises leaves the occurrence to Inductor (as without pricing), the failure in the report."""
    monkeypatch.setattr(price, "COMPILE", price.inductor)
    torch.manual_seed(0)
    model, x = SwiGLU(), torch.randn(3, 5, 16)
    ref = SwiGLU()
    ref.load_state_dict(model.state_dict())
    opt = opsmath.optimize(model, inductor=True)
    opt(x).backward()
    ref(x).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert sorted(priced["calls"]) == ["inductor", "opsmath"]
    assert [d.pattern for d in opsmath.report(opt).declines if "Inductor's fusion" in d.reason] == ["swiglu"]

    def broken(gm, inputs):
        raise RuntimeError("injected compile failure")
    monkeypatch.setattr(price, "COMPILE", broken)
    torch._dynamo.reset()     # new sizes on the same frame would make its graph dynamic (not priced)
    other = opsmath.optimize(SwiGLU(d=8, h=12), inductor=True)
    other(torch.randn(2, 8)).backward()
    rep = opsmath.report(other)
    assert not rep.matches
    assert len(rep.declines) == 1 and rep.declines[0].reason.startswith(
        "left to Inductor: measuring failed (AllCandidatesFailed: every candidate failed for price:swiglu")


def test_symbolic_sizes_are_not_priced(priced):
    """A graph whose sizes became symbolic (a third sequence length) keeps the families left to Inductor,
    measuring nothing."""
    model = SwiGLU()
    opt = opsmath.optimize(model, inductor=True)
    for t in (5, 7, 9):
        opt(torch.randn(2, t, 16)).backward()
    last = opsmath.report(opt).graphs[-1]
    assert last.dynamic and not [m for m in last.matches if m.pattern == "swiglu"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="prices by GPU kernel time")
def test_on_the_gpu_every_priced_occurrence_is_measured_and_the_step_equals_eager(monkeypatch, tmp_path):
    """Real timing on CUDA: each priced family's occurrence is kept with its times or put back with them
    (or with why measuring failed), and the step still equals eager's."""
    monkeypatch.setenv("OPSMATH_PRICE", "1")
    monkeypatch.setenv("OPSMATH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(price, "_VERDICTS", {})
    ref, model, batch = pair(dropout=0.0)
    ref, model = ref.cuda(), model.cuda()
    batch = [t.cuda() for t in batch]
    opt = opsmath.optimize(model)
    loss, ref_loss = opt(*batch), ref(*batch)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5)
    rep = opsmath.report(opt)
    kept = [m for m in rep.matches if m.pattern in PRICED]
    back = [d for d in rep.declines if d.pattern in PRICED and "left as written" not in d.reason]
    assert kept or back
    assert all(" ms" in m.details["priced"] for m in kept)
    assert all("Inductor" in d.reason for d in back), [d.reason for d in back]
    print({m.pattern: m.details["priced"] for m in kept}, {d.pattern: d.reason for d in back})


def test_pricing_time_is_bounded_per_process_and_cached_verdicts_still_apply(priced, monkeypatch):
    """Once a process spent ``OPSMATH_PRICE_SECONDS`` measuring, unmeasured occurrences are left to Inductor
    with that reason; a verdict already cached is still applied."""
    priced["times"] = {"inductor": 2.0, "opsmath": 1.0}
    ref, model, batch = pair(dropout=0.0)
    opsmath.optimize(model, inductor=True)(*batch).backward()
    kept = len([m for m in opsmath.report(model).matches if m.pattern in PRICED])
    monkeypatch.setattr(price, "SPENT", [1e9])
    ref, again, batch = pair(dropout=0.0)
    again = opsmath.optimize(again, inductor=True)
    step_equals_eager(again, ref, batch)
    assert len([m for m in opsmath.report(again).matches if m.pattern in PRICED]) == kept    # cached
    torch._dynamo.reset()
    model = SwiGLU()
    opt = opsmath.optimize(model, inductor=True)
    opt(torch.randn(2, 3, 16)).backward()
    assert [d.reason for d in opsmath.report(opt).declines][0].startswith(
        "left to Inductor, not priced: this process spent its 60 s of pricing")
    monkeypatch.setenv("OPSMATH_PRICE_SECONDS", "soon")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="OPSMATH_PRICE_SECONDS='soon'"):
        opsmath.optimize(SwiGLU(), inductor=True)(torch.randn(2, 3, 16))
