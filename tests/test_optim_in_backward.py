"""``opsmath.optim.AdamW(in_backward=True)``: every parameter updated inside backward equals
``torch.optim.AdamW`` stepping after it, no ``.grad`` is left, and what needs every gradient first
(clipping, accumulation, GradScaler) is a clear error."""
import copy

import pytest
import torch
import torch.nn as nn

import opsmath
from opsmath.optim import AdamW

from conftest import DEVICE


def _model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 37), nn.GELU(), nn.LayerNorm(37), nn.Linear(37, 29), nn.ReLU(),
                         nn.Linear(29, 5)).to(device)


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [dict(params=decay, weight_decay=0.1), dict(params=no_decay, weight_decay=0.0, lr=2e-3)]


def _batch(i, device):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 13, generator=g).to(device), torch.randn(8, 5, generator=g).to(device)


def _train(model, opt, steps, device, check_grads_freed=False):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))   # lr changes between steps
    for i in range(steps):
        x, y = _batch(i, device)
        loss = ((model(x) - y) ** 2).mean() * 10
        loss.backward()
        if check_grads_freed:
            assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
        sched.step()


@pytest.mark.parametrize("bucket_bytes", [1, 2**25])   # a launch per parameter, or one per backward
@pytest.mark.parametrize("path", ["reference", "triton"])
def test_in_backward_equals_torch_adamw_and_frees_every_grad(path, bucket_bytes, request):
    if path == "triton":
        request.getfixturevalue("triton_on_cpu")
    device = DEVICE if path == "triton" else "cpu"
    ref_model, our_model = _model(device), _model(device)
    ref = torch.optim.AdamW(_groups(ref_model), lr=1e-3, betas=(0.9, 0.95))
    ours = AdamW(_groups(our_model), lr=1e-3, betas=(0.9, 0.95), in_backward=True, bucket_bytes=bucket_bytes)
    _train(ref_model, ref, 4, device)
    _train(our_model, ours, 4, device, check_grads_freed=True)
    for a, b in zip(our_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sd, sd_ref = ours.state_dict(), ref.state_dict()
    for i, st in sd_ref["state"].items():
        for k in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][i][k], st[k], rtol=1e-5, atol=1e-7)


def test_in_backward_under_optimize_equals_eager():
    """The hooks fire on the parameters of an optimized model (compiled backward) as on eager ones."""
    eager_model = _model()
    our_model = opsmath.optimize(copy.deepcopy(eager_model))
    ref = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    ours = AdamW(our_model.parameters(), lr=1e-3, in_backward=True)
    _train(eager_model, ref, 3, "cpu")
    _train(our_model, ours, 3, "cpu", check_grads_freed=True)
    for a, b in zip(our_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_what_needs_every_gradient_first_is_a_clear_error():
    model = _model()
    with pytest.raises(ValueError, match="max_grad_norm"):
        AdamW(model.parameters(), in_backward=True, max_grad_norm=1.0)

    opt = AdamW(model.parameters(), in_backward=True)
    for i in range(2):                       # two backward passes, then one step: accumulation
        x, y = _batch(i, "cpu")
        ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match="accumulation"):
        opt.step()

    x, y = _batch(3, "cpu")
    ((model(x) - y) ** 2).mean().backward()
    opt.grad_scale = torch.ones(())          # what torch.amp.GradScaler.step hands a fused optimizer
    with pytest.raises(RuntimeError, match="GradScaler"):
        opt.step()


def test_param_group_added_later_is_stepped_in_backward():
    model = _model()
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    opt = AdamW(first, lr=1e-3, in_backward=True)
    opt.add_param_group(dict(params=rest))
    x, y = _batch(0, "cpu")
    before = [p.detach().clone() for p in model.parameters()]
    ((model(x) - y) ** 2).mean().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def _backward_functions(loss) -> int:
    """AOTAutograd functions in ``loss``'s autograd graph: one per compiled graph."""
    seen, todo, count = set(), [loss.grad_fn], 0
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        count += "CompiledFunction" in type(fn).__name__
        todo.extend(f for f, _ in fn.next_functions)
    return count


def test_under_inductor_each_block_is_a_graph_of_its_own():
    """Under Inductor one graph's backward returns every gradient at its end: with an in-backward
    optimizer the model is captured block by block (``runtime/blocks.py``), so each block's gradients are
    applied and freed as its own backward ends. The gradients the optimizer applies are eager's (fp32
    rounding apart), and the parameters follow torch's AdamW (Adam's normalized update turns a rounding
    difference in a near-zero gradient into a share of lr)."""
    from opsmath import examples
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager, batch = examples.gpt(batch_size=2, seq_len=16, n_layer=3, dropout=0.0)
    ours = opsmath.optimize(copy.deepcopy(eager), inductor=True)
    ref_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt = AdamW(ours.parameters(), lr=1e-3, in_backward=True)
    applied = {}
    for p in ours.parameters():   # registered after the optimizer's: runs before its bucket is applied
        p.register_post_accumulate_grad_hook(lambda p: applied.update({p: p.grad.clone()}) if p not in applied
                                             else None)
    for step in range(2):
        loss = ours(*batch)
        if step == 0:
            assert _backward_functions(loss) >= 3
        loss.backward()
        assert all(p.grad is None for p in ours.parameters())
        opt.step()
        opt.zero_grad()
        eager(*batch).backward()
        if step == 0:
            for a, b in zip(ours.parameters(), eager.parameters()):
                torch.testing.assert_close(applied[a], b.grad, rtol=1e-4, atol=1e-6)
        ref_opt.step()
        ref_opt.zero_grad()
    assert any("one per block" in n for n in ours._opsmath.notes)
    for a, b in zip(ours.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_graph_left_whole_says_why_its_gradients_arrive_at_once():
    """No silent skip: with an in-backward optimizer, a graph that stays one Inductor graph is named in
    the report with its reason (autograd Functions or checkpoints, no repeated blocks)."""
    from opsmath.runtime.blocks import PIECE, split_for_optimizer
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    gm = torch.fx.symbolic_trace(model)
    assert split_for_optimizer(model, gm, {}) == (None, None)   # torch's optimizer (none yet): nothing to say
    AdamW(model.parameters(), lr=1e-3, in_backward=True)
    parts, why = split_for_optimizer(model, gm, {})
    assert parts is None and "fewer than two blocks" in why
    assert "autograd Functions" in split_for_optimizer(model, gm, {"f": object()})[1]
    gm.meta[PIECE] = True
    assert split_for_optimizer(model, gm, {}) == (None, None)   # a block's own piece


def test_under_a_byte_budget_each_block_is_planned_for_its_share():
    """A byte ``memory_budget`` with an in-backward optimizer: the model is still captured block by block,
    and each piece but the last is planned at its first call for its share of the budget's headroom
    (``memory.budget.share_budget``: by the bytes its nodes produce against the later pieces'), so that
    the first blocks do not keep what the last ones need; the last piece plans for what is left. The
    recompute keeps training exact: the parameters follow eager's with torch's AdamW."""
    from opsmath import examples
    from opsmath.memory.budget import share_budget
    from opsmath.meta_keys import BLOCK_SHARE
    assert share_budget("1GiB", (1, 3), 2**29) == 2**29 + 2**27 and share_budget("1GiB", (1, 0), 0) is None
    assert share_budget(0.5, (1, 3), 0) is None and share_budget("1GiB", None, 0) is None
    # the tensors handed on from this piece and the later ones come off the headroom first
    assert share_budget("1GiB", (1, 3, 2**28), 2**29) == 2**29 + 2**26
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager, batch = examples.gpt(batch_size=2, seq_len=64, n_layer=3, dropout=0.0)
    budget = 1_800_000   # below what the blocks keep unconstrained, above what stays resident (CPU's model)
    ours = opsmath.optimize(copy.deepcopy(eager), inductor=True, memory_budget=budget)
    opt, ref_opt = AdamW(ours.parameters(), lr=1e-3, in_backward=True), torch.optim.AdamW(eager.parameters(), lr=1e-3)
    for _ in range(2):
        ours(*batch).backward()
        opt.step()
        opt.zero_grad()
        eager(*batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    plans = [g.plan for g in opsmath.report(ours).graphs]
    assert len(plans) == 3 and any("one per block" in n for n in ours._opsmath.notes)
    shares = [g.source.meta[BLOCK_SHARE] for g in opsmath.report(ours).graphs]
    assert shares[0][2] > shares[1][2] > 0 and shares[-1][1] == 0, "each hands the residual stream on"
    assert all(p.budget < budget for p in plans[:-1]) and plans[-1].budget == budget
    assert any(p.kept < p.unconstrained for p in plans[:-1]), "the shares recompute"
    # each share keeps back what the later pieces need at their floors (``runtime.budgets.reserve_floors``)
    from opsmath.runtime.budgets import piece_floor
    from opsmath.runtime.backend import piece_rewrite
    rewrite = piece_rewrite(ours._opsmath, True)
    floors = [piece_floor(g.source, "tag", rewrite) for g in opsmath.report(ours).graphs]
    assert all(floor > 0 and grads > 0 for floor, grads in floors)
    assert shares[0][3] == max(f + g for f, g in floors[1:]) - floors[0][1] and shares[-1][3] == 0
    assert piece_floor(torch.fx.symbolic_trace(nn.Linear(2, 2)), "tag") == (None, 0), "no example values"
    assert all(p.share_of_budget for p in plans[:-1]), "a share is planned untimed: what it keeps is bounded"
    for a, b in zip(ours.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_in_backward_auto_is_turned_on_where_the_whole_graph_cannot_meet_a_byte_budget():
    """``in_backward="auto"``: where a byte budget cannot be met by the whole graph (every gradient alive at
    the backward's end counted), the planner turns the in-backward step on and plans block by block (one
    block's gradients alive at a time), the report saying so; training stays exact. Without "auto", or
    with a clip (which needs every gradient first), the same budget is an error before the first step."""
    from opsmath import examples
    from opsmath.memory.budget import InfeasibleBudget
    budget = 1_300_000   # below the whole graph's floor (CPU's model: weights, every gradient, activations)

    def build(**opt_kw):
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager, batch = examples.gpt(batch_size=2, seq_len=64, n_layer=3, dropout=0.0)
        ours = opsmath.optimize(copy.deepcopy(eager), inductor=True, memory_budget=budget)
        return eager, batch, ours, AdamW(ours.parameters(), lr=1e-3, **opt_kw)
    for kw in (dict(), dict(in_backward="auto", max_grad_norm=1.0)):
        _, batch, ours, opt = build(**kw)
        with pytest.raises(InfeasibleBudget):
            ours(*batch)
        assert opt._in_backward is None
    eager, batch, ours, opt = build(in_backward="auto")
    ref_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    for _ in range(2):
        ours(*batch).backward()
        assert all(p.grad is None for p in ours.parameters())
        opt.step()
        opt.zero_grad()
        eager(*batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert opt._in_backward is not None and not opt.in_backward_auto
    assert any("in_backward='auto'" in n for n in ours._opsmath.notes)
    assert len(opsmath.report(ours).graphs) == 3
    for a, b in zip(ours.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_piece_whose_share_is_below_its_floor_keeps_its_share_else_plans_at_its_floor(monkeypatch):
    """A block's share below its floor: the piece keeps at most its share (what it keeps, the later pieces
    lose) with its backward under the whole budget (the later pieces are done by then); where no plan
    does, it plans for its floor; at or above the budget, no share plan."""
    from opsmath.memory.budget import InfeasibleBudget
    from opsmath.runtime import budgets
    import types
    asked, bounded, kept = [], [True], types.SimpleNamespace()

    def first_plan(gm, by_node, budget, *args, **kw):
        asked.append((budget, kw.get("step")))
        if kw.get("step") and bounded[0]:
            return kept
        if budget < 700:
            raise InfeasibleBudget("below", 700)
        return budget
    monkeypatch.setattr(budgets, "first_plan", first_plan)
    assert budgets._at_share(None, None, 500, 1000, 100, 0, False, {}) is kept and kept.share_step
    assert asked == [(500, None), (500, (900, 400))]
    asked.clear()
    bounded[0] = False
    assert budgets._at_share(None, None, 500, 1000, 100, 0, False, {}) == 701
    assert asked == [(500, None), (500, (900, 400)), (701, None)]
    monkeypatch.setattr(budgets, "first_plan", lambda *a, **k: (_ for _ in ()).throw(InfeasibleBudget("x", 1200)))
    assert budgets._at_share(None, None, 500, 1000, 100, 0, False, {}) is None

def test_pieces_below_their_floor_keep_no_more_than_their_share(monkeypatch):
    """8 blocks under a byte budget whose shares are below each block's floor peak: each piece but the last
    keeps at most its share of the headroom, or where even that is below what it must keep, the least it
    can (here 6% of its activations; planned at its floor peak it kept 56%, 1.18 MB a block, which the
    later blocks then lacked: HF LLaMA 1.1B on a 12 GiB card ran out at block 16), its backward peaking
    above the share but under the whole budget. Planning only: the graphs run op by op."""
    from opsmath import examples
    from opsmath.runtime import backend
    monkeypatch.setattr(backend, "compile_fx", lambda gm, example_inputs, **kw: gm)
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager, batch = examples.gpt(batch_size=4, seq_len=128, n_layer=8, n_embd=64, n_head=4, vocab_size=128,
                                dropout=0.0)
    budget = 4_000_000
    ours = opsmath.optimize(eager, inductor=True, memory_budget=budget)
    opt = AdamW(ours.parameters(), lr=1e-3, in_backward=True)
    ours(*batch).backward()
    opt.step()
    plans = [g.plan for g in opsmath.report(ours).graphs]
    assert len(plans) == 8
    assert all(p.kept <= max(int(p.budget) - p.resident, 0.1 * p.unconstrained) for p in plans[:-1]), \
        [(p.kept, int(p.budget) - p.resident, p.unconstrained) for p in plans]
    assert all(p.resident + p.kept + p.transient <= budget for p in plans)
    assert any(p.transient > int(p.budget) - p.resident for p in plans[:-1]), "some piece is below its floor"



def test_a_re_plan_of_a_piece_kept_within_its_share_keeps_both_bounds(monkeypatch):
    """A piece planned below its floor (``share_step``) and planned again after step 1 (resident bytes
    moved, a measured error): what it keeps is bounded by its share again, its backward by the whole
    budget, both less the error; planned for its share alone it would be infeasible."""
    import types
    from opsmath.memory import replan
    seen = {}

    def plan_and_emit(g, by_node, budget, resident, **kw):
        seen.update(budget=budget, resident=resident, step=kw.get("step"))
        return types.SimpleNamespace(predicted_peak=0, expected_peak=None)
    monkeypatch.setattr(replan, "plan_and_emit", plan_and_emit)
    old = types.SimpleNamespace(link=None, estimated_by="", budget=500, allocator="", optimizer="",
                                share_of_budget=True, share_step=True)
    record, state = types.SimpleNamespace(plan=old, calls=2), types.SimpleNamespace(memory_budget=1000)
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    plan, _ = replan._plan_for(state, record, gm, {}, 500, (20, 0), 100, True, "why", [], False, False)
    assert seen == dict(budget=480, resident=100, step=(880, 380)) and plan.share_step
