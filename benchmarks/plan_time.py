"""How long the memory plan takes to make: HF LLaMA (SDPA, hidden 128, MLP 344, 4/2 heads, vocab 256,
B2 T128) at several depths and fractions, op by op on CPU, one step each; prints the first graph's
``plan.planning_seconds``, modelled recompute, kept share and the step's first-call time.

    python -m benchmarks plan_time [--cases 8:0.5,8:0.25,12:0.3,22:0.3]
"""
import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import opsmath


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="8:0.5,8:0.25,12:0.3,22:0.3", help="layers:fraction, comma-separated")
    args = ap.parse_args()
    for case in args.cases.split(","):
        layers, frac = int(case.split(":")[0]), float(case.split(":")[1])
        torch.manual_seed(0)
        torch._dynamo.reset()
        cfg = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
        model = opsmath.optimize(LlamaForCausalLM(cfg), memory_budget=frac, inductor=False)
        x = torch.randint(0, 256, (2, 128))
        t0 = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        first = time.perf_counter() - t0
        p = next(g.plan for g in opsmath.report(model).graphs if g.plan is not None)
        print(f"{layers:3d} layers, fraction {frac}: planned in {p.planning_seconds:.2f} s over {len(p.segments)} "
              f"segments, modelled recompute {p.recompute_seconds * 1e3:.4f} ms, kept {p.kept / p.unconstrained:.4f}, "
              f"first step {first:.1f} s", flush=True)


if __name__ == "__main__":
    main()
