"""``opsmath.optim.AdamW`` keeps ``torch.optim.Optimizer``'s contract: ``state`` is the truth (replaced,
cleared, an entry deleted or a tensor swapped, the next step uses what is there, as torch's AdamW does), and
a non-finite clipped gradient norm does what ``clip_grad_norm_`` + torch's AdamW do unless skipping is asked
for. The Triton path runs in the interpreter on CPU (``triton_on_cpu``), the reference path on CPU tensors."""
from collections import defaultdict

import pytest
import torch

from opsmath.optim import AdamW
from test_optim_adamw import _batch, _model

RESETS = {
    "replaced": lambda opt, p: setattr(opt, "state", defaultdict(dict)),
    "cleared": lambda opt, p: opt.state.clear(),
    "deleted": lambda opt, p: opt.state.__delitem__(p),
    "swapped": lambda opt, p: opt.state[p].__setitem__("exp_avg", torch.zeros_like(opt.state[p]["exp_avg"])),
}


def _step(model, opt, i, clip=None, poison=False):
    x, y = _batch(i, next(model.parameters()).device)
    opt.zero_grad()
    (((model(x) - y) ** 2).mean() * 100).backward()
    if poison:
        next(model.parameters()).grad[0, 0] = float("inf")
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


@pytest.fixture(params=["reference", "triton"])
def path(request):
    if request.param == "triton":
        request.getfixturevalue("triton_on_cpu")
    return request.param


@pytest.mark.parametrize("how", sorted(RESETS))
def test_state_changed_between_steps_is_what_the_next_step_uses(how, path):
    ours_m, ref_m = _model(), _model()
    ours = AdamW(ours_m.parameters(), lr=1e-2, max_grad_norm=1.0)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    for i in range(2):
        _step(ours_m, ours, i)
        _step(ref_m, ref, i, clip=1.0)
    for opt, m in ((ours, ours_m), (ref, ref_m)):
        RESETS[how](opt, next(m.parameters()))
    for i in range(2, 4):
        _step(ours_m, ours, i)
        _step(ref_m, ref, i, clip=1.0)
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    saved, expected = ours.state_dict()["state"], ref.state_dict()["state"]
    assert sorted(saved) == sorted(expected)
    for i in expected:
        assert float(saved[i]["step"]) == float(expected[i]["step"])
        torch.testing.assert_close(saved[i]["exp_avg"], expected[i]["exp_avg"], rtol=1e-5, atol=1e-7)


def test_inf_gradient_with_clipping_does_what_torch_does(path):
    ours_m, ref_m = _model(), _model()
    ours = AdamW(ours_m.parameters(), lr=1e-2, max_grad_norm=1.0)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    _step(ours_m, ours, 0)
    _step(ref_m, ref, 0, clip=1.0)
    _step(ours_m, ours, 1, poison=True)
    _step(ref_m, ref, 1, clip=1.0, poison=True)
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.isnan(next(ours_m.parameters())).any()          # as torch: the inf reached the weights
    assert float(ours.state[next(ours_m.parameters())]["step"]) == 2


def test_skip_nonfinite_skips_and_counts(path):
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, skip_nonfinite=True)
    _step(model, opt, 0)
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, opt, 1, poison=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert float(opt.state[next(model.parameters())]["step"]) == 1 and int(opt.skipped_steps) == 1
    _step(model, opt, 2)
    assert float(opt.state[next(model.parameters())]["step"]) == 2 and int(opt.skipped_steps) == 1
