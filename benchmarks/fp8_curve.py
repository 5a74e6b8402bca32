"""FP8 training learns as bf16 does: loss curves of ``opsmath.optimize(fp8=True)`` against bf16 runs.

One model, one learnable token stream (``learning_curve.batches``: each token the previous plus 1-3, mod
the vocabulary, so the loss falls from ln(V) towards ln 3), AdamW with warm-up, bf16 weights, ``--steps``
steps. Runs: opsmath bf16 from init seed 0 and from seed 1 (run-to-run noise: the same recipe, another
initialization), opsmath FP8 from seed 0, and torchao float8 + compile from seed 0 when torchao is
installed. Metric: the largest gap of 20-step means, FP8 vs bf16 seed 0, against the same gap between the
two bf16 seeds (the row "bf16 seed 1"); both also over the last 100 steps. Writes ``results/fp8_curve-*.json`` and a PNG.

    python -m benchmarks fp8_curve [--model llama] [--steps 500] [--batch 2] [--seq 2048]
    python -m benchmarks fp8_curve --model gpt2 --batch 8 --seq 1024 --fp8-min-dim 768 --data-vocab 1024 --amp

``--model gpt2`` is GPT-2-small as nanoGPT writes it (``opsmath.examples.GPT``, 12 x 768, vocab 50304,
dropout off). Its GEMMs (768 wide) are below the per-layer FP8 rule's threshold, so with the rule as it is
nothing runs FP8; ``--fp8-min-dim 768`` lowers the threshold so every linear does (a numerics test, not the
speed setting). ``--data-vocab`` draws the token stream from the first N ids only, so the loss can fall
from ln(vocab) to ln 3 within a few hundred steps instead of plateauing on a vocabulary-sized lookup.
``--runs`` picks the runs (the first is the reference): ``{bf16,fp8,fp8 head bf16} seed {0,1,2}`` and
``bf16 seed 0 again``; ``fp8 head bf16`` keeps the LM head in bf16 (``skip=["fp8_linear@*lm_head"]``).
``--amp``: fp32 master weights under bf16 autocast (bf16 weights leave LayerNorm's gains, near 1.0, where an
update of lr 3e-4 rounds away: GPT-2-small with bf16 weights sat at ln(data vocab) for 450 steps).
"""
from __future__ import annotations

import argparse
import time

import torch

import opsmath
from benchmarks._harness import write
from benchmarks.hf_default_attention import MODELS, build, torchao_float8
from benchmarks.learning_curve import batches
from opsmath.examples import GPT

WINDOW = 20
HEAD_BF16 = dict(fp8=True, skip=["fp8_linear@*lm_head"])   # torchao's recipe keeps the output layer bf16
RUNS = {f"{kind} seed {seed}": (seed, lambda m, o=options: opsmath.optimize(m, **o))
        for kind, options in (("bf16", {}), ("fp8", dict(fp8=True)), ("fp8 head bf16", HEAD_BF16))
        for seed in (0, 1, 2)}
RUNS["bf16 seed 0 again"] = (0, opsmath.optimize)


class NanoGPT(torch.nn.Module):
    """GPT-2-small (``opsmath.examples.GPT``) with the HF call convention the loop uses."""

    def __init__(self, **cfg):
        super().__init__()
        self.gpt = GPT(**cfg)
        for m in self.modules():   # nanoGPT's init: with PyTorch's defaults (N(0, 1) position embeddings
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):   # over tiny token ones) it sits at
                torch.nn.init.normal_(m.weight, 0.0, 0.02)              # ln(vocab) for hundreds of steps
                if getattr(m, "bias", None) is not None:
                    torch.nn.init.zeros_(m.bias)

    def forward(self, input_ids, labels, use_cache=False):
        return _Out(self.gpt(input_ids, labels))


class _Out:
    def __init__(self, loss):
        self.loss = loss


def build_model(name, device, seed, amp=False):
    """The model in bf16, or with fp32 master weights when ``amp`` (the loop runs it under bf16 autocast)."""
    if not name.startswith("gpt2"):
        model = build(name, device, seed=seed)
        return model.float() if amp else model
    torch.manual_seed(seed)
    cfg = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768) if name == "gpt2" else \
        dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)   # "gpt2-tiny": --smoke
    model = NanoGPT(dropout=0.0, **cfg)
    return model.to(device=device, dtype=torch.bfloat16 if device == "cuda" and not amp else torch.float32).train()


def train(model, data, steps, lr, amp=False):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=torch.cuda.is_available())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    losses = []
    for i in range(steps):
        x, y = data[i % len(data)]
        with torch.autocast(x.device.type, torch.bfloat16, enabled=amp):
            loss = model(input_ids=x, labels=y, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses).float().tolist()


def smooth(xs):
    return [sum(xs[i:i + WINDOW]) / WINDOW for i in range(0, len(xs) - WINDOW + 1, WINDOW)]


def gap(a, b, last=None):
    a, b = (a, b) if last is None else (a[-last:], b[-last:])
    return max(abs(x - y) for x, y in zip(smooth(a), smooth(b)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--fp8-min-dim", type=int, default=None,
                    help="run FP8 on every linear whose dims reach this (default: the per-layer rule)")
    ap.add_argument("--data-vocab", type=int, default=None, help="token stream modulus (default: the vocabulary)")
    ap.add_argument("--amp", action="store_true", help="fp32 master weights under bf16 autocast (default: bf16 weights)")
    ap.add_argument("--runs", default="bf16 seed 0,fp8 seed 0,bf16 seed 1,bf16 seed 0 again",
                    help=f"comma-separated, from {sorted(RUNS)} (the first is the reference)")
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip runs that start after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, 40 steps: checks the script")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.model, args.steps, args.batch, args.seq = ("gpt2-tiny" if args.model == "gpt2" else "tiny"), 40, 2, 32
    vocab = args.data_vocab or {"gpt2": 50304, "gpt2-tiny": 256}.get(args.model) or MODELS[args.model][2]["vocab_size"]
    from opsmath.patterns import fp8_linear as rule
    thresholds = rule.MIN_DIM, rule.SHARED_MIN_DIM
    if args.fp8_min_dim is not None:
        rule.MIN_DIM = rule.SHARED_MIN_DIM = args.fp8_min_dim
    try:
        run(args, device, vocab)
    finally:   # the rule's thresholds as they were (a run inside another process leaves them unchanged)
        rule.MIN_DIM, rule.SHARED_MIN_DIM = thresholds


def run(args, device, vocab):
    """The runs of ``args.runs`` (and torchao's), each trained and summarized as it ends."""
    data = batches(min(args.steps, 200), args.batch, args.seq, vocab, device)
    # the comparison first, the noise level next: a run cut short by --budget-s keeps the FP8 curve
    runs = {label: RUNS[label] for label in args.runs.split(",")}
    import importlib.util
    if args.no_torchao or importlib.util.find_spec("torchao") is None:
        print("torchao's run is left out (not installed, or --no-torchao)", flush=True)
    else:
        runs["torchao float8 seed 0"] = (0, torchao_float8)
    curves, info, start = {}, {}, time.perf_counter()
    for label, (seed, wrap) in runs.items():
        if time.perf_counter() - start > args.budget_s:
            print(f"{label}: skipped (--budget-s)", flush=True)
            continue
        torch._dynamo.reset()
        model = wrap(build_model(args.model, device, seed, args.amp))
        t0 = time.perf_counter()
        curves[label] = train(model, data, args.steps, args.lr, args.amp)
        info[label] = dict(seconds=time.perf_counter() - t0, last100=sum(curves[label][-100:]) / 100)
        if hasattr(model, "_opsmath"):
            info[label]["fp8_linears"] = sum(m.pattern == "fp8_linear" for m in opsmath.report(model).matches)
        print(f"{label:24} {info[label]}", flush=True)
        del model
        torch.cuda.empty_cache() if device == "cuda" else None
        summarize(args, curves, info)


def summarize(args, curves, info):
    """The gaps so far (written after every run: a run cut short keeps what it measured)."""
    ref = curves.get(args.runs.split(",")[0])
    if ref is None:
        return
    summary = {label: dict(gap=gap(c, ref), gap_last100=gap(c, ref, 100)) for label, c in curves.items()}
    for k, v in summary.items():
        print(f"{k:24} largest gap of {WINDOW}-step means vs the first run: {v['gap']:.4f}, "
              f"over the last 100: {v['gap_last100']:.4f}", flush=True)
    if not args.smoke:
        path = write(f"fp8_curve-{args.model}", dict(args=vars(args), info=info, summary=summary, curves=curves))
        print("wrote", path)
        _plot(curves, path.replace(".json", ".png"))


def _plot(curves, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, c in curves.items():
        s = smooth(c)
        ax.plot([WINDOW * (i + 1) for i in range(len(s))], s, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({WINDOW}-step mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


if __name__ == "__main__":
    main()
