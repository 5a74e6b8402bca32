"""How well the memory plan knows what a step saves: the activation bytes the plan counts (Inductor's
partition on CUDA, eager autograd's saved set otherwise) against the bytes a real forward leaves
allocated for its backward, on the same model (GPT-2-small or HF LLaMA 1.1B, bf16 autocast).

    python -m benchmarks plan_estimate [--model llama|gpt] [--budget 1.0] [--smoke]

``--budget 1.0`` plans without recompute, so the plan's count is the unconstrained one; a smaller
fraction shows what the plan keeps against what stays allocated. Measured: ``memory_allocated`` after
the forward minus before it, steps 2-4 (the plan's own; optimizer state exists from step 1 on), and the
step's peak. Writes ``plan_estimate-<model>-<date>.json`` into ``$OUT`` (or benchmarks/results).
"""
import argparse
import os

import torch

import opsmath
from benchmarks._harness import write
from benchmarks._models import build, build_llama


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("llama", "gpt"), default="llama")
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny model (no memory measured)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.model == "llama":
        cfg = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256) if args.smoke else {}
        model, (B, T) = build_llama(cfg, device, "eager"), ((2, 64) if args.smoke else (4, 2048))
    else:
        cfg = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1) if args.smoke else \
            dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.1)
        model, (B, T) = build(cfg, device, "eager"), ((2, 64) if args.smoke else (8, 1024))
    model = opsmath.optimize(model, memory_budget=args.budget)
    idx = torch.randint(0, cfg.get("vocab_size", 32000), (B, T), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    kept, peaks = [], []
    for _ in range(4):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=not args.smoke):
            loss = model(idx, torch.roll(idx, -1, 1))
        if device == "cuda":
            kept.append(torch.cuda.memory_allocated() - before)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            peaks.append(torch.cuda.max_memory_allocated())
    rec = opsmath.report(model).graphs
    plans = [r.plan.to_dict() for r in rec if r.plan is not None]
    for p in plans:
        p.pop("timeline"), p.pop("chosen")
    eager = [r.saved_bytes[1] for r in rec]
    gib = lambda b: "-" if b is None else f"{b / 2**30:.3f}"  # noqa: E731
    for p in plans:
        print(f"plan: activations {gib(p['unconstrained'])} GiB as {p['estimated_by']} saves them, kept "
              f"{gib(p['kept'])}, resident {gib(p['resident'])}, predicted peak {gib(p['predicted_peak'])} (bound), "
              f"expected {gib(p.get('expected_peak'))}")
    print(f"eager autograd's saved set: {[gib(e) for e in eager]} GiB")
    print(f"measured: left allocated by the forward {[gib(k) for k in kept]} GiB, step peaks {[gib(p) for p in peaks]}")
    if not args.smoke:
        write(f"plan_estimate-{args.model}", dict(model=args.model, budget=args.budget, batch=[B, T], plans=plans,
                                                  eager_saved=eager, forward_kept=kept, peaks=peaks))


if __name__ == "__main__":
    os.environ.setdefault("OPSMATH_CACHE_DIR", os.path.join(os.environ.get("OUT", "/tmp"), "opsmath-cache"))
    main()
