"""A byte budget held from the first step (``opsmath.memory.first_plan``), on CPU with CUDA's measurement stood
in for: the first plan counts the optimizer state that its step lacks and holds a margin back for the
error no step has measured yet; the second call spends what the margin held back beyond the measured
error; a budget the resident bytes already exceed is an error before the first step, naming the state.
And ``opsmath.optim.footprint``: each optimizer layout's bytes before its state exists."""

import pytest
import torch

import opsmath
from opsmath.memory import first_plan, replan
from opsmath.memory.plan import InfeasibleBudget
from opsmath.optim import footprint
from opsmath.runtime import budgets

from test_replan import _assert_same_step, _probed_gpt


def test_state_to_come_per_layout():
    """torch's AdamW assumed (two moments in the parameter's dtype); opsmath's AdamW read: 32-bit,
    8-bit (codes + fp32 block maxima), fp32 master for 16-bit; nothing once the state exists, nothing for
    a frozen parameter."""
    a, b = torch.nn.Parameter(torch.zeros(300)), torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    frozen = torch.nn.Parameter(torch.zeros(7), requires_grad=False)
    assert footprint.state_to_come([a, b, frozen]) == (2 * 300 * 4 + 2 * 10 * 2,) * 2
    q8 = opsmath.optim.AdamW([a], state_bits=8)
    master = opsmath.optim.AdamW([b], master_weights=True)
    assert footprint.state_to_come([a, b]) == (2 * 300 + 2 * 4 * 2 + 12 * 10, 0)
    a.grad = torch.ones_like(a)
    q8.step()
    assert footprint.state_to_come([a, b]) == (12 * 10, 0)
    del q8, master


def _as_on_cuda(monkeypatch, state, error, opt_model):
    """Steps measured as on CUDA: ``state`` bytes of optimizer state to come at the first call, resident
    from the second on; each step peaks ``error`` above its plan's model of a step without the state."""
    real, calls = replan.resident_bytes, []
    monkeypatch.setattr(budgets, "optimizer_state_to_come", lambda args, model, stepped: 0 if stepped else state)
    monkeypatch.setattr(replan, "measures", lambda args: True)
    monkeypatch.setattr(replan, "resident_bytes", lambda args, model: real(args, model) + state)

    def peak(args):
        p = opsmath.report(opt_model[0]).graphs[0].plan
        calls.append(1)
        ahead = p.to_come if len(calls) <= 2 else 0   # step 1 (two windows) ran without the state
        return max(p.modelled) - ahead + error
    monkeypatch.setattr(replan, "start_peak", lambda args: 0)
    monkeypatch.setattr(replan, "max_allocated", peak)


def test_first_step_counts_the_state_and_holds_a_margin_then_spends_it(monkeypatch):
    model, ref, batch, p = _probed_gpt()
    state, error = int(0.3 * p.unconstrained), int(0.02 * p.unconstrained)
    budget = int(p.resident + state + 0.8 * p.unconstrained)
    holder = [None]
    _as_on_cuda(monkeypatch, state, error, holder)
    opt = holder[0] = opsmath.optimize(model, memory_budget=budget)
    opt(*batch).backward()
    first = opsmath.report(opt).graphs[0].plan
    assert first.to_come == state and first.resident >= p.resident + state
    assert first.first_margin == int(first_plan.FIRST_STEP_MARGIN * (budget - first.resident))
    assert first.predicted_peak <= budget and first.excess == first.first_margin
    assert max(first.modelled) - state + error <= budget   # what step 1 measured: under the budget
    model.zero_grad()
    opt(*batch).backward()
    second = opsmath.report(opt).graphs[0].plan
    assert second is not first and "held" in second.replanned
    assert second.first_margin == 0 and second.excess >= error and second.predicted_peak <= budget
    assert second.kept + second.transient > first.kept + first.transient   # the slack spent: less recompute
    model.zero_grad()
    _assert_same_step(opt, ref, batch)


def test_a_budget_the_optimizer_state_exceeds_fails_before_the_first_step(monkeypatch):
    model, ref, batch, p = _probed_gpt()
    state = 4 * p.resident
    holder = [None]
    _as_on_cuda(monkeypatch, state, 0, holder)
    opt = holder[0] = opsmath.optimize(model, memory_budget=int(p.resident + 0.9 * p.unconstrained))
    with pytest.raises(InfeasibleBudget, match="optimizer state that its first step allocates"):
        opt(*batch)


def test_reserved_beyond_allocated_is_held_too(monkeypatch):
    """The allocator reserved ``gap`` beyond the allocated peak in step 1: the re-plan takes it off the
    budget beside the model's error, so the budget holds in reserved memory."""
    model, ref, batch, p = _probed_gpt()
    state, error, gap = int(0.3 * p.unconstrained), int(0.02 * p.unconstrained), int(0.1 * p.unconstrained)
    budget = int(p.resident + state + 0.8 * p.unconstrained)
    holder = [None]
    _as_on_cuda(monkeypatch, state, error, holder)
    monkeypatch.setattr(replan, "_gap", lambda args, allocated: gap)
    opt = holder[0] = opsmath.optimize(model, memory_budget=budget)
    opt(*batch).backward()
    model.zero_grad()
    opt(*batch).backward()
    second = opsmath.report(opt).graphs[0].plan
    assert "reserved beyond the allocated peak" in second.replanned
    assert second.excess >= error + gap and second.predicted_peak <= budget


def test_auto_state_bits_lever():
    """``state_bits="auto"``: the lever offers 32-bit minus 8-bit bytes while the state is to come, and
    its switch makes the group 8-bit; fixed ``state_bits`` offer nothing."""
    a, b = torch.nn.Parameter(torch.zeros(1000)), torch.nn.Parameter(torch.zeros(500))
    auto, fixed = opsmath.optim.AdamW([a], state_bits="auto"), opsmath.optim.AdamW([b])
    saved, switch = footprint.eight_bit_lever([a, b])
    assert saved == 8 * 1000 - (2 * 1000 + 8 * 4)
    switch()
    assert auto.param_groups[0]["state_bits"] == 8 and fixed.param_groups[0]["state_bits"] == 32
    assert footprint.eight_bit_lever([a, b]) == (0, None)
    with pytest.raises(ValueError, match="'auto'"):
        opsmath.optim.AdamW([b], state_bits=16)


def test_a_budget_only_8bit_state_meets_is_met_with_it(monkeypatch):
    """A byte budget below resident + 32-bit moments: an optimizer with ``state_bits="auto"`` is made 8-bit
    before its first step, the report says so with the bytes saved, and training matches eager with the
    same 8-bit optimizer."""
    model, ref, batch, p = _probed_gpt(batch_size=1)
    n = sum(q.numel() for q in model.parameters())
    state8 = 2 * n + 8 * sum(-(-q.numel() // 256) for q in model.parameters())
    budget = int(p.resident + 6 * n + 0.1 * p.unconstrained)   # 32-bit: 0.1 of the activations left
    monkeypatch.setattr(budgets, "optimizer_state_to_come",
                        lambda args, m, stepped: 0 if stepped else footprint.state_to_come(m.parameters())[0])
    monkeypatch.setattr(replan, "measures", lambda args: True)
    opt_model = opsmath.optimize(model, memory_budget=budget)
    adam = opsmath.optim.AdamW(model.parameters(), lr=1e-3, state_bits="auto")
    ref_adam = opsmath.optim.AdamW(ref.parameters(), lr=1e-3, state_bits=8)
    plans = []
    for _ in range(2):
        for m, o in ((opt_model, adam), (ref, ref_adam)):
            m(*batch).backward()
            o.step()
            o.zero_grad()
        plans.append(opsmath.report(opt_model).graphs[0].plan)
    first = plans[0]
    assert adam.param_groups[0]["state_bits"] == 8 and "8-bit" in first.optimizer
    assert first.to_come == state8 and first.predicted_peak <= budget
    assert "made 8-bit" in plans[1].optimizer and "made 8-bit" in str(opsmath.report(opt_model))
    assert all("exp_avg_q" in adam.state[q] for q in model.parameters())
    # the recomputed step's gradients equal eager's to fp32 rounding, which can move a moment across one
    # 8-bit code: an update apart by up to a tenth of lr (1e-3)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_a_parameter_some_optimizer_stepped_has_no_state_to_come():
    """torch's global step hook records the parameters of each optimizer's first step: their state
    exists (in the allocated bytes), so nothing is assumed for them any more."""
    a = torch.nn.Parameter(torch.zeros(10))
    assert footprint.state_to_come([a]) == (80, 80)
    opt = torch.optim.SGD([a], lr=0.1)
    a.grad = torch.ones_like(a)
    opt.step()
    assert footprint.state_to_come([a]) == (0, 0)


def test_auto_state_bits_resumes_as_the_budget_chose():
    """A checkpoint of a group the budget made 8-bit loads into ``state_bits="auto"`` as 8-bit: its state
    is not decoded to 32-bit moments at the next step."""
    a = torch.nn.Parameter(torch.randn(300))
    opt = opsmath.optim.AdamW([a], state_bits="auto")
    footprint.eight_bit_lever([a])[1]()
    a.grad = torch.ones_like(a)
    opt.step()
    b = torch.nn.Parameter(a.detach().clone())
    resumed = opsmath.optim.AdamW([b], state_bits="auto")
    resumed.load_state_dict(opt.state_dict())
    assert resumed.param_groups[0]["state_bits"] == 8
    b.grad = torch.ones_like(b)
    resumed.step()
    assert "exp_avg_q" in resumed.state[b] and "exp_avg" not in resumed.state[b]
