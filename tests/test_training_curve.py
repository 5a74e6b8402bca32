"""docs/design.md: fixed-seed training of a small model for >= 100 steps tracks eager's loss curve.
Dropout off: step by step within fp32 rounding growth. Dropout on (masks differ by construction): the
smoothed curves agree within the step-to-step noise of the eager curve itself."""
import copy

import torch

import opsmath
from opsmath import examples

STEPS = 120


def _curve(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for idx, tgt in batches:
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses)


def _setup(dropout):
    torch.manual_seed(0)
    model, _ = examples.gpt(batch_size=8, seq_len=32, n_layer=2, dropout=dropout)
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, 64, (4096,), generator=g)   # a small vocabulary: learnable in 120 steps
    batches = []
    for _ in range(STEPS):
        s = torch.randint(0, len(text) - 33, (8,), generator=g)
        chunk = torch.stack([text[i:i + 33] for i in s])
        batches.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
    return model, batches


def test_loss_curve_equals_eager_without_dropout():
    model, batches = _setup(0.0)
    eager = copy.deepcopy(model)
    ours = _curve(opsmath.optimize(model), batches)
    ref = _curve(eager, batches)
    rel = ((ours - ref).abs() / ref.abs()).max().item()
    assert rel < 1e-3, rel
    assert ref[-10:].mean() < ref[:10].mean() * 0.9   # it did learn


def test_loss_curve_tracks_eager_with_dropout():
    model, batches = _setup(0.1)
    eager = copy.deepcopy(model)
    torch.manual_seed(2)
    ours = _curve(opsmath.optimize(model), batches)
    torch.manual_seed(2)
    ref = _curve(eager, batches)
    smooth = lambda x: x.unfold(0, 20, 20).mean(1)  # noqa: E731  (means over 20-step windows)
    noise = (ref[1:] - ref[:-1]).abs().mean().item()   # eager's own step-to-step variation
    assert (smooth(ours) - smooth(ref)).abs().max().item() < noise, (smooth(ours), smooth(ref), noise)
