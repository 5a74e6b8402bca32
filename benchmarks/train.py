"""End-to-end training step on the GPU, one process, same data and seed for every variant.

GPT-2-small (12x768, B8 T1024, bf16 autocast, dropout 0.1, attention written by hand) with AdamW:
eager; eager + SDPA; torch.compile; torch.compile + SDPA; ``opsmath.optimize``; ``opsmath.optimize`` +
``opsmath.optim.AdamW``; ``torch.compile(opsmath.optimize(model))``; and torch.compile + SDPA and
``opsmath.optimize`` each replayed as CUDA graphs (``mode="reduce-overhead"``, ``cuda_graphs=True``).
``--llama``: Hugging Face ``LlamaForCausalLM`` 1.1B (bf16 weights, B4 T2048),
``attn_implementation="eager"`` vs ``"sdpa"``. For each: median step ms over ``--steps`` timed steps after
two warm-up steps, tokens/s, peak memory (``max_memory_allocated`` over the timed steps) and the first
step's wall time (capture + compile).
The first loss of every variant is printed: same init and data, so they agree to bf16 noise.

    python benchmarks/train.py [--gpt] [--llama] [--steps 10] [--only NAME]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch

import opsmath
import opsmath.optim
from _models import GPT2_SMALL, build, hf_llama


def run_variant(name, make_model, make_opt, batch, amp, steps):
    """``batch`` is ``(args, kwargs)`` of the model call; its output is the loss or has ``.loss``."""
    args, kwargs = batch
    dev = args[0].device.type
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch._dynamo.reset()
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        model = make_model()
        opt = make_opt(model)

        def step():
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
                out = model(*args, **kwargs)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        t0 = time.perf_counter()
        first_loss = step().item()
        first_s = time.perf_counter() - t0
        step()
        sync()
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        tokens = args[0].numel()
        row = dict(name=name, ms=ms, tok_s=tokens / ms * 1e3, peak_gib=torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0,
                   first_step_s=first_s, first_loss=first_loss)
        if hasattr(model, "_opsmath") or hasattr(getattr(model, "_orig_mod", None), "_opsmath"):
            rep = opsmath.report(getattr(model, "_orig_mod", model))
            row["rewrites"] = dict(Counter(m.pattern for g in rep.graphs for m in g.matches))
            row["attention_backends"] = sorted({m.details.get("backend", "") for g in rep.graphs
                                                for m in g.matches if m.pattern == "attention"})
            row["graphs"] = len(rep.graphs)
            row["capture_s"] = sum(g.capture_seconds for g in rep.graphs)
            row["inductor_s"] = sum(g.inductor_seconds for g in rep.graphs)
            row["fallbacks"] = rep.fallback_errors
    except Exception as e:  # recorded, not fatal: the other variants still run
        row = dict(name=name, error=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        model = opt = None
    print(f"{name:34} " + (f"{row['ms']:8.1f} ms {row['tok_s']:9.0f} tok/s {row['peak_gib']:6.2f} GiB "
                           f"first {row['first_step_s']:6.1f} s loss {row['first_loss']:.4f} "
                           f"{row.get('attention_backends', '')}" if "ms" in row else row["error"]), flush=True)
    return row


def variants(kind, device="cuda"):
    """name -> (model factory, optimizer factory)."""
    if kind == "gpt":
        cfg = GPT2_SMALL if device == "cuda" else dict(GPT2_SMALL, n_layer=2, n_embd=64, n_head=4,
                                                         vocab_size=256, block_size=64)
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
    ap.add_argument("--llama", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", default="", help="comma-separated variant names to run")
    ap.add_argument("--smoke", action="store_true", help="tiny GPT on CPU: checks the script, measures nothing")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.steps = 1
    kinds = [k for k in ("gpt", "llama") if getattr(args, k)] or ["gpt"]
    only = [s for s in args.only.split(",") if s]
    out = {}
    for kind in kinds:
        torch.manual_seed(0)
        if kind == "gpt":
            B, T, V, amp = (8, 1024, GPT2_SMALL["vocab_size"], True) if not args.smoke else (2, 64, 256, False)
        else:
            B, T, V, amp = 4, 2048, 32000, False
        idx = torch.randint(0, V, (B, T), device=dev)
        batch = ((idx, torch.roll(idx, -1, 1)), {}) if kind == "gpt" else \
            ((idx,), dict(labels=idx, use_cache=False))
        print(f"== {kind}: B{B} T{T}", flush=True)
        out[kind] = dict(batch=[B, T], rows=[run_variant(n, mm, mo, batch, amp, args.steps)
                                             for n, (mm, mo) in variants(kind, dev).items()
                                             if not only or n in only])
    if not args.smoke:
        from _harness import write
        print("wrote", write("train-" + "-".join(kinds), out))


if __name__ == "__main__":
    main()
