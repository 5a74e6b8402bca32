"""Training where the sequence length changes every step: ``torch.compile`` (automatic dynamic shapes)
vs ``opsmath.optimize``, Hugging Face LLaMA with its default (SDPA) attention, in one process.

The run: ``--steps`` steps, each with a length drawn (seeded) from ``[--min-len, --max-len]``, at least
20 distinct. Phase 1 (cold): each variant runs the whole sequence from a fresh compile; its total
time, per-step times (capture and compile included, so the steps that recompile stand out), graphs and
unoptimized calls are recorded. Phase 2 (warm): the variants alternate over ``--rounds`` rounds of the
same sequence (A B A B); per round the sequence's total time, median and spread over rounds.

    python -m benchmarks varying_lengths [--steps 30] [--rounds 3] [--model 1b|4layer|bloom4|tiny]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import opsmath
from benchmarks._harness import interleave, write

CONFIGS = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
               intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096),
    "4layer": dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                   intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256),
    # BLOOM-1B7's layer shape, 4 layers: its GeLU autograd.Function splits every layer's graph into pieces,
    # which compile once per length and then once with symbolic sizes (pieces.py)
    "bloom4": dict(arch="Bloom", hidden_size=2048, n_layer=4, n_head=16, vocab_size=32000, hidden_dropout=0.0,
                   attention_dropout=0.0),
    "bloom-tiny": dict(arch="Bloom", hidden_size=64, n_layer=2, n_head=4, vocab_size=256, hidden_dropout=0.0,
                       attention_dropout=0.0),
}


def build(cfg, device):
    import transformers
    torch.manual_seed(0)
    arch = cfg.get("arch", "Llama")
    cfg = {k: v for k, v in cfg.items() if k != "arch"}
    model = getattr(transformers, arch + "ForCausalLM")(getattr(transformers, arch + "Config")(**cfg))
    return model.to(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32).train()


def run_sequence(model, opt, batches, sync):
    times = []
    for ids in batches:
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        if times[-1] > 1:   # a (re)compile: show progress as it happens
            print(f"  step {len(times)} (length {ids.shape[1]}): {times[-1]:.1f} s", flush=True)
    return times


class Sequence:
    """A variant's model and optimizer, warm: a timed round trains on the first ``steps`` batches of the
    sequence and adds their total seconds to ``row["warm_total_s"]`` (``interleave`` alternates the variants)."""

    def __init__(self, model, opt, row, batches, sync):
        self.model, self.opt, self.row, self.batches, self.sync = model, opt, row, batches, sync

    def timed_round(self, steps, accumulate=1):
        times = run_sequence(self.model, self.opt, self.batches[:steps], self.sync)
        self.row.setdefault("warm_total_s", []).append(sum(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--model", default="1b")
    ap.add_argument("--order", default="torch.compile,opsmath.optimize",
                    help="variants in the order their cold phase runs (the first is not slowed by a timeout)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, measures nothing")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.model = "bloom-tiny" if args.model.startswith("bloom") else "tiny"
        args.steps, args.rounds, args.min_len, args.max_len, args.batch = 6, 1, 8, 24, 2
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cfg = CONFIGS[args.model]
    rng = random.Random(0)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.steps)]
    batches = [torch.randint(0, cfg["vocab_size"], (args.batch, T), device=device) for T in lengths]
    variants = {}
    wraps = {"torch.compile": torch.compile, "opsmath.optimize": opsmath.optimize}
    for label in args.order.split(","):
        wrap = wraps[label]
        model = wrap(build(cfg, device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
        cold = run_sequence(model, opt, batches, sync)
        row = dict(name=label, cold_total_s=sum(cold), cold_step_s=cold)
        if hasattr(model, "_opsmath"):
            rep = opsmath.report(model)
            row.update(graphs=[dict(dynamic=g.dynamic, calls=g.calls, capture_s=g.capture_seconds,
                                    attention=sum(m.pattern == "attention" for m in g.matches))
                               for g in rep.graphs], unoptimized_calls=rep.unoptimized_calls,
                       fallbacks=rep.fallback_errors)
        variants[label] = Sequence(model, opt, row, batches, sync)
        print(f"{label:18} cold: {sum(cold):7.1f} s for {len(lengths)} steps ({len(set(lengths))} lengths); "
              f"steps over 1 s: {[round(t, 1) for t in cold if t > 1]} {row.get('graphs', '')}", flush=True)
    interleave(list(variants.values()), args.rounds, len(batches))     # warm, A B A B
    rows = [v.row for v in variants.values()]
    for r in rows:
        r["warm_median_s"] = statistics.median(r["warm_total_s"])
        r["ms_per_step"] = r["warm_median_s"] / len(lengths) * 1e3
        print(f"{r['name']:18} warm: {r['warm_median_s']:.3f} s per sequence "
              f"[{min(r['warm_total_s']):.3f}-{max(r['warm_total_s']):.3f}], {r['ms_per_step']:.1f} ms/step", flush=True)
    if not args.smoke:
        print("wrote", write("varying_lengths", dict(lengths=lengths, batch=args.batch, config=cfg, rows=rows)))


if __name__ == "__main__":
    main()
