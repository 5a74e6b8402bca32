"""The rule and op-spec registries: every family registered once, ordered by its declared constraints,
and the driver's contract (a user's skip is reported for every family)."""
import pytest
import torch
import torch.nn.functional as F

import opsmath
from opsmath.kernels import SPECS
from opsmath.rewrite.rules import RULES, Rule, ordered


def _rule(name, after=()):
    return type(name, (Rule,), dict(name=name, anchors=(torch.ops.aten.mul.Tensor,), after=after))()


def test_every_family_has_a_rule_an_op_spec_and_a_place_in_the_order():
    from opsmath import patterns
    assert set(RULES) == set(patterns.NAMES)
    assert set(RULES) <= set(SPECS)               # each rule's replacement op declares its spec
    order = patterns.NAMES
    for rule in RULES.values():
        assert rule.anchors, rule.name
        for first in rule.after:
            assert order.index(first) < order.index(rule.name), (first, rule.name)


def test_order_honours_after_and_keeps_registration_order_otherwise():
    rules = {r.name: r for r in (_rule("c", after=("d",)), _rule("a"), _rule("d"), _rule("b", after=("a",)))}
    assert [r.name for r in ordered(rules)] == ["a", "d", "c", "b"]


def test_order_rejects_cycles_and_unknown_families():
    with pytest.raises(ValueError, match="cycle"):
        ordered({r.name: r for r in (_rule("x", after=("y",)), _rule("y", after=("x",)))})
    with pytest.raises(ValueError, match="not registered"):
        ordered({"x": _rule("x", after=("nope",))})


class _Loss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, logits, target):   # logits a graph input: cross_entropy's, not the fused linear's
        return F.cross_entropy(logits.float().view(-1, 8) * 1.0 + self.proj.bias, target)


def test_a_skipped_cross_entropy_is_reported_like_any_family():
    model = opsmath.optimize(_Loss(), skip=["cross_entropy"], inductor=False)
    model(torch.randn(4, 8, requires_grad=True), torch.randint(0, 8, (4,))).backward()
    rep = opsmath.report(model)
    reasons = [(d.pattern, d.reason) for g in rep.graphs for d in g.declines]
    assert ("cross_entropy", "skipped by the user") in reasons, reasons
    assert not any(m.pattern == "cross_entropy" for g in rep.graphs for m in g.matches)


@pytest.mark.parametrize("skip, rewrites", [(["attention@h.1.attn"], 2), (["attention@h.*.attn"], 0),
                                            (["attention@h.0"], 2), (["attention@h.3", "attention@h.1.at"], 3)])
def test_skip_names_the_modules_an_occurrence_lies_in(skip, rewrites):
    """``skip`` takes a module's qualified name or a glob after the family: occurrences inside it (or
    any module it contains) are left alone and reported as skipped; the others are rewritten."""
    from opsmath.examples import GPT
    torch.manual_seed(0)
    model = opsmath.optimize(GPT(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=0.0),
                             skip=skip, inductor=False)
    x = torch.randint(0, 64, (2, 16))
    model(x, x).backward()
    rep = opsmath.report(model)
    rewritten = [m for g in rep.graphs for m in g.matches if m.pattern == "attention"]
    skipped = [d for g in rep.graphs for d in g.declines if d.reason == "skipped by the user"]
    assert len(rewritten) == rewrites and len(skipped) == 3 - rewrites, (rewritten, skipped)
