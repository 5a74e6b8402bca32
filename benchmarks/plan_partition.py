"""The recompute plan against what Inductor's partition then saves, on HF LLaMA 1.1B's shapes without a
GPU: the model (``_models.llama_config``, fp32 weights, bf16 autocast, B4 T2048 by default) is captured
on CPU, planned under ``--budgets`` for Inductor (``inductor=True``), and stopped before anything runs;
the plan's kept bytes and modelled recompute are set beside the bytes Inductor's partition of the
tagged graph saves (``analysis.partitioned_saved_bytes``, fake tensors). Each budget is planned with the
plan's cheap steps (weight copies, selective-free and selective-tensors runs) and without
(``OPSMATH_CHEAP_STEPS=0``).

    python -m benchmarks plan_partition [--layers 16] [--budgets 0.5,0.25] [--batch 4] [--seq 2048]

Writes ``plan_partition-<date>.json`` into ``$OUT`` (or benchmarks/results). A full forward never runs:
the planning compile of Inductor up to its partition is the cost (about 15 s a plan at 16 layers).
"""
import argparse
import os

import torch

import opsmath
from benchmarks._harness import write
from benchmarks._models import build_llama
from opsmath.memory import analysis
from opsmath.runtime import backend


class _Planned(Exception):
    """Raised once the graph is planned: nothing after it is needed."""


def plan_once(layers: int, batch: int, seq: int, budget: float) -> dict:
    """Plan the model under ``budget`` (the capture on CPU, the partition read on fake tensors) and read
    Inductor's partition of the planned graph."""
    found, real_plan = {}, backend.plan_graph

    def record(state, model, source, gm, by_node, example_inputs, use_inductor):
        found["plan"], found["saved"] = real_plan(state, model, source, gm, by_node, example_inputs, use_inductor)
        found["gm"], found["inputs"] = gm, example_inputs
        raise _Planned
    backend.plan_graph = record
    torch._dynamo.reset()
    try:
        model = opsmath.optimize(build_llama(dict(num_hidden_layers=layers), "cpu", "eager"), memory_budget=budget,
                                 inductor=True)
        idx = torch.randint(0, 32000, (batch, seq))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx, idx)
    except Exception as e:  # noqa: BLE001  (dynamo wraps the stop in its own error)
        if "_Planned" not in repr(e) and not isinstance(e, _Planned):
            raise
    finally:
        backend.plan_graph = real_plan
    plan = found["plan"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tagged = analysis.partitioned_saved_bytes(found["gm"], found["inputs"])
    return dict(budget=budget, unconstrained=plan.unconstrained, weight_copies=sum(found["saved"].casts.values()),
                kept=plan.kept, partition_saves=sum(tagged.values()), recompute_ms=plan.recompute_seconds * 1e3,
                planning_s=plan.planning_seconds, recomputed=len(plan.chosen), selective=len(plan.selective),
                selective_free=sum(1 for i in plan.selective if plan.segments[i].only is not None) - len(plan.tensors),
                tensors=len(plan.tensors), casts=len(plan.casts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budgets", default="0.5,0.25")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    rows = []
    for b in (float(x) for x in args.budgets.split(",") if x):
        for cheap in ("1", "0"):
            os.environ["OPSMATH_CHEAP_STEPS"] = cheap
            try:
                row = dict(plan_once(args.layers, args.batch, args.seq, b), cheap_steps=cheap == "1")
            finally:
                os.environ.pop("OPSMATH_CHEAP_STEPS")
            rows.append(row)
            g = 2**30
            print(f"budget {b} {'with' if cheap == '1' else 'without'} cheap steps: modelled recompute "
                  f"{row['recompute_ms']:.2f} ms, plan keeps {row['kept'] / g:.3f} GiB, the partition saves "
                  f"{row['partition_saves'] / g:.3f} GiB (of {row['unconstrained'] / g:.3f}; weight copies "
                  f"{row['weight_copies'] / g:.3f}); {row['recomputed']} recomputed, {row['selective']} selective "
                  f"({row['selective_free']} free, {row['tensors']} with GEMMs), {row['casts']} with weight copies; planned in "
                  f"{row['planning_s']:.2f} s", flush=True)
    print("wrote", write("plan_partition", dict(rows=rows, layers=args.layers, batch=[args.batch, args.seq])))


if __name__ == "__main__":
    main()
