"""End-to-end training step on the GPU, one process, same data and seed for every variant.

GPT-2-small (12x768, B8 T1024, bf16 autocast, dropout 0.1, attention written by hand) with AdamW:
eager; eager + SDPA; torch.compile; torch.compile + SDPA; ``opsmath.optimize``; ``opsmath.optimize`` +
``opsmath.optim.AdamW``; ``torch.compile(opsmath.optimize(model))``; and torch.compile + SDPA and
``opsmath.optimize`` each replayed as CUDA graphs (``mode="reduce-overhead"``, ``cuda_graphs=True``).
``--gpt6``: the same at 6 layers x 512 wide, B16 T512, where host time dominates more.
``--llama``: Hugging Face ``LlamaForCausalLM`` 1.1B (bf16 weights, B4 T2048),
``attn_implementation="eager"`` vs ``"sdpa"``. Every variant is built and warmed up (first step timed:
capture + compile; the third step's peak memory above what is resident), then the variants alternate:
``--rounds`` rounds in which each runs ``--steps`` timed steps (A B A B: the host's noise falls on all of
them). Per variant: median of the per-round medians and their spread [min-max], GPU kernel time per step
(torch.profiler), tokens/s, the step's peak. The first loss of every variant is printed: same init and
data, so they agree to bf16 noise.

    python -m benchmarks train [--gpt] [--gpt6] [--llama] [--rounds 5] [--steps 3] [--only NAME,NAME]
"""
from __future__ import annotations

import argparse
from collections import Counter

import torch

import opsmath
import opsmath.optim
from benchmarks._harness import Stepper, interleave, kernel_ms, write
from benchmarks._models import GPT2_SMALL, build, hf_llama

GPT_6x512 = dict(GPT2_SMALL, n_layer=6, n_embd=512, n_head=8, block_size=512)


class Runner(Stepper):
    """One variant: its model and optimizer from their factories, stepped on one batch (``Stepper``: warm-up
    and timed rounds, alternated with the other variants by ``interleave``)."""

    def __init__(self, name, make_model, make_opt, batch, amp):
        (self.args, self.kwargs), self.amp = batch, amp
        super().__init__(name, self.args[0].device.type)
        self.model = make_model()
        self.opt = make_opt(self.model)

    def step(self, accumulate: int = 1):
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.amp):
            out = self.model(*self.args, **self.kwargs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def row(self):
        if self.error:
            return dict(name=self.label, error=self.error)
        row = dict(name=self.label, **self.timing())
        row.update(tok_s=self.args[0].numel() / row["ms"] * 1e3, step_peak_gib=self.peak_gib,
                   first_step_s=self.first_s, first_loss=self.first_loss)
        if self.device == "cuda":
            row["gpu_ms"] = sum(kernel_ms(self.step, calls=3).values())
        target = getattr(self.model, "_orig_mod", self.model)
        if hasattr(target, "_opsmath"):
            rep = opsmath.report(target)
            row.update(rewrites=dict(Counter(m.pattern for m in rep.matches)), graphs=len(rep.graphs),
                       attention_backends=sorted({m.details.get("backend", "") for m in rep.matches
                                                  if m.pattern == "attention"}),
                       capture_s=sum(g.capture_seconds for g in rep.graphs),
                       inductor_s=sum(g.inductor_seconds for g in rep.graphs), fallbacks=rep.fallback_errors,
                       notes=rep.notes)   # with CUDA graphs: Inductor's reasons for any graph it left out
        return row


def run(kind, dev, batch, amp, rounds, steps, only):
    """Every variant built and warmed up (a failure is recorded, not fatal), then ``rounds`` rounds in
    which each runs ``steps`` timed steps in turn."""
    runners = []
    for name, (make_model, make_opt) in variants(kind, dev).items():
        if only and name not in only:
            continue
        try:
            r = Runner(name, make_model, make_opt, batch, amp)
            r.warm_up()
            runners.append(r)
            print(f"{name:34} first step {r.first_s:6.1f} s, loss {r.first_loss:.4f}", flush=True)
        except Exception as e:
            failed = Runner.__new__(Runner)   # a row with the error only
            failed.label, failed.error = name, f"{type(e).__name__}: {str(e)[:300]}"
            runners.append(failed)
            print(f"{name:34} {failed.error}", flush=True)
    interleave([r for r in runners if not r.error], rounds, steps, catch=True)
    rows = [r.row() for r in runners]
    for row in rows:
        print(f"{row['name']:34} " + (f"{row['ms']:8.2f} ms [{row['ms_min']:.2f}-{row['ms_max']:.2f}] "
                                      f"gpu {row.get('gpu_ms', 0):7.2f} ms {row['tok_s']:9.0f} tok/s "
                                      f"peak {row['step_peak_gib']:6.2f} GiB {row.get('attention_backends', '')}"
                                      if "ms" in row else row["error"]), flush=True)
    return rows


def variants(kind, device="cuda"):
    """name -> (model factory, optimizer factory)."""
    if kind in ("gpt", "gpt6"):
        cfg = GPT2_SMALL if kind == "gpt" else GPT_6x512
        if device != "cuda":
            cfg = dict(cfg, n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=64)
        hand = lambda: build(cfg, device, "eager")  # noqa: E731
        sdpa = lambda: build(cfg, device, "sdpa")  # noqa: E731
    else:
        hand = lambda: hf_llama("eager")  # noqa: E731
        sdpa = lambda: hf_llama("sdpa")  # noqa: E731
    torch_adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device == "cuda")  # noqa: E731
    ops_adamw = lambda m: opsmath.optim.AdamW(m.parameters(), lr=1e-4)  # noqa: E731
    return {
        "eager": (hand, torch_adamw),
        "eager + SDPA": (sdpa, torch_adamw),
        "torch.compile": (lambda: torch.compile(hand()), torch_adamw),
        "torch.compile + SDPA": (lambda: torch.compile(sdpa()), torch_adamw),
        "opsmath.optimize": (lambda: opsmath.optimize(hand()), torch_adamw),
        "opsmath.optimize (attention only)": (lambda: opsmath.optimize(hand(), patterns=["attention"]),
                                              torch_adamw),
        # every family applied under Inductor too: the evidence for (or against) INDUCTOR_FUSES_BETTER
        "opsmath.optimize (every family)": (lambda: opsmath.optimize(hand(), patterns=opsmath.patterns.NAMES),
                                            torch_adamw),
        "opsmath.optimize + opsmath AdamW": (lambda: opsmath.optimize(hand()), ops_adamw),
        "torch.compile(opsmath.optimize)": (lambda: torch.compile(opsmath.optimize(hand())), torch_adamw),
        # both with CUDA-graph replay (Inductor's CUDA-graph trees): launch overhead removed on each side
        "torch.compile + SDPA (CUDA graphs)": (lambda: torch.compile(sdpa(), mode="reduce-overhead"), torch_adamw),
        "opsmath.optimize (CUDA graphs)": (lambda: opsmath.optimize(hand(), cuda_graphs=True), torch_adamw),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt", action="store_true")
    ap.add_argument("--gpt6", action="store_true", help="6 layers x 512 wide, B16 T512: host time dominates more")
    ap.add_argument("--llama", action="store_true")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; in each, every variant runs --steps steps")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated variant names to run")
    ap.add_argument("--smoke", action="store_true", help="tiny GPT on CPU: checks the script, measures nothing")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.rounds, args.steps = 2, 1
    kinds = [k for k in ("gpt", "gpt6", "llama") if getattr(args, k)] or ["gpt"]
    only = [s for s in args.only.split(",") if s]
    out = {}
    for kind in kinds:
        torch.manual_seed(0)
        if kind in ("gpt", "gpt6"):
            B, T, V, amp = ((8, 1024) if kind == "gpt" else (16, 512)) + (GPT2_SMALL["vocab_size"], True)
            if args.smoke:
                B, T, V, amp = 2, 64, 256, False
        else:
            B, T, V, amp = 4, 2048, 32000, False
        idx = torch.randint(0, V, (B, T), device=dev)
        batch = ((idx, torch.roll(idx, -1, 1)), {}) if kind != "llama" else \
            ((idx,), dict(labels=idx, use_cache=False))
        print(f"== {kind}: B{B} T{T}", flush=True)
        out[kind] = dict(batch=[B, T], rounds=args.rounds, steps=args.steps,
                         rows=run(kind, dev, batch, amp, args.rounds, args.steps, only))
        if not args.smoke:   # after each model: a run cut short keeps what it measured
            print("wrote", write("train-" + "-".join(kinds), out), flush=True)


if __name__ == "__main__":
    main()
