"""Learning is unchanged: 200 steps from one seed, a small GPT (6x384, B16 T256, bf16 autocast), eager vs
``opsmath.optimize``, same initial weights and the same token stream, AdamW. Run twice: dropout off
(the two curves should agree step by step to bf16 rounding) and dropout 0.1 (masks differ by
construction, so the curves are compared after smoothing).

Metric, stated with the result: with dropout off, the largest per-step relative loss difference;
with dropout on, the largest difference of 20-step means, against eager's own step-to-step noise
(mean |loss[t+1] - loss[t]|). Writes ``results/learning_curve-*.json`` and a PNG of the curves.

    python -m benchmarks learning_curve [--steps 200] [--smoke]
"""
from __future__ import annotations

import argparse
import copy
import os

import torch

import opsmath
from opsmath.examples import GPT


def batches(steps, B, T, vocab, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    # a learnable stream: each token is the previous one plus 1, 2 or 3 (mod vocab), so the loss can
    # fall from ln(vocab) towards ln(3)
    text = torch.randint(1, 4, (200_000,), generator=g).cumsum(0) % vocab
    out = []
    for _ in range(steps):
        s = torch.randint(0, len(text) - T - 1, (B,), generator=g)
        chunk = torch.stack([text[i:i + T + 1] for i in s]).to(device)
        out.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
    return out


def curve(model, data, device, amp):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    torch.manual_seed(2)
    for idx, tgt in data:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="tiny, CPU, 20 steps: checks the script")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    steps = 20 if args.smoke else args.steps
    cfg = dict(vocab_size=512, block_size=256, n_layer=6, n_head=6, n_embd=384)
    B, T = 16, 256
    if args.smoke:
        cfg, B, T = dict(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32), 4, 32
    data = batches(steps, B, T, cfg["vocab_size"], device)
    result = {}
    for dropout in (0.0, 0.1):
        torch.manual_seed(0)
        eager = GPT(dropout=dropout, **cfg).to(device)
        ours = opsmath.optimize(copy.deepcopy(eager))
        torch._dynamo.reset()
        ref = curve(eager, data, device, not args.smoke)
        got = curve(ours, data, device, not args.smoke)
        noise = (ref[1:] - ref[:-1]).abs().mean().item()
        k = min(20, steps // 2)
        smooth = lambda x: x[: len(x) // k * k].view(-1, k).mean(1)  # noqa: E731
        result[f"dropout={dropout}"] = dict(
            eager=ref.tolist(), opsmath=got.tolist(), eager_step_noise=noise,
            max_rel_step_diff=((got - ref).abs() / ref.abs()).max().item(),
            max_smoothed_diff=(smooth(got) - smooth(ref)).abs().max().item(),
            first=ref[0].item(), last_eager=ref[-5:].mean().item(), last_opsmath=got[-5:].mean().item())
        r = result[f"dropout={dropout}"]
        print(f"dropout {dropout}: loss {r['first']:.3f} -> eager {r['last_eager']:.3f}, opsmath "
              f"{r['last_opsmath']:.3f}; max step rel diff {r['max_rel_step_diff']:.2e}; max {k}-step-mean "
              f"diff {r['max_smoothed_diff']:.4f} vs eager step noise {noise:.4f}", flush=True)
    if args.smoke:
        return
    from benchmarks._harness import write
    path = write("learning_curve", dict(config=cfg, batch=[B, T], steps=steps, curves=result))
    print("wrote", path)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for ax, (name, r) in zip(axes, result.items()):
            ax.plot(r["eager"], label="eager", lw=1)
            ax.plot(r["opsmath"], label="opsmath.optimize", lw=1, ls="--")
            ax.set_title(name)
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.legend()
        png = os.path.splitext(path)[0] + ".png"
        fig.tight_layout()
        fig.savefig(png, dpi=100)
        print("wrote", png)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
