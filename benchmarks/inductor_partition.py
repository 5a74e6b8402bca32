"""What a memory budget's plan really does once Inductor partitions the graph: the activations AOTAutograd's
partitioner saves for backward (forward outputs beyond the user's, deduplicated by storage) and the GEMM
FLOPs the backward runs, for each budget, next to what the planner predicted. Runs on CPU (Inductor's C++
backend) or CUDA; no timing, so it answers "how much memory for how much recomputed GEMM work" anywhere.
The model is ``examples.gpt`` (nanoGPT blocks, vocabulary 256: the blocks' economics, not the LM head's;
under a budget the LM-head loss becomes opsmath's chunked op, whose GEMMs this count does not see).

    python -m benchmarks inductor_partition [--layers 4 --width 256 --heads 4 --seq 256 --batch 4] [--budgets none,0.75,0.5]
"""
from __future__ import annotations

import argparse
import contextlib

import torch
import torch._functorch.partitioners as partitioners
import torch._inductor.compile_fx as compile_fx
from torch.multiprocessing.reductions import StorageWeakRef

import opsmath
from opsmath import examples
from benchmarks._harness import write

_GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


@contextlib.contextmanager
def _capture_partitions(store: list):
    """Wrap the min-cut partitioner so every (forward, backward, number of user outputs) lands in ``store``;
    torch's functions are put back on leaving."""
    orig, orig_fx = partitioners.min_cut_rematerialization_partition, compile_fx.min_cut_rematerialization_partition

    def wrapped(joint, inputs, **kw):
        fw, bw = orig(joint, inputs, **kw)
        store.append((fw, bw, kw.get("num_fwd_outputs")))
        return fw, bw
    partitioners.min_cut_rematerialization_partition = wrapped
    compile_fx.min_cut_rematerialization_partition = wrapped
    try:
        yield store
    finally:
        partitioners.min_cut_rematerialization_partition = orig
        compile_fx.min_cut_rematerialization_partition = orig_fx


def saved_bytes(fw, n_user: int) -> int:
    """Bytes of the distinct storages the forward hands to backward (graph inputs excluded)."""
    out = next(n for n in fw.graph.nodes if n.op == "output")
    seen, total = set(), 0
    for n in out.args[0][n_user:]:
        v = getattr(n, "meta", {}).get("val")
        if n.op == "placeholder" or not isinstance(v, torch.Tensor):
            continue
        ref = StorageWeakRef(v.untyped_storage())
        if ref not in seen:
            seen.add(ref)
            total += v.untyped_storage().nbytes()
    return total


def gemm_flops(gm) -> float:
    total = 0.0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _GEMMS:
            a = n.args[1] if n.target is torch.ops.aten.addmm.default else n.args[0]
            total += 2 * n.meta["val"].numel() * a.meta["val"].shape[-1]
    return total


def sweep(args, store: list) -> list[dict]:
    """One row per budget of ``args.budgets`` (an infeasible one printed and left out), ``store`` filled by
    the partitioner as each step compiles."""
    rows = []
    for text in args.budgets.split(","):
        budget = None if text == "none" else float(text)
        torch._dynamo.reset()
        store.clear()
        torch.manual_seed(0)
        model, batch = examples.gpt(batch_size=args.batch, seq_len=args.seq, n_layer=args.layers,
                                    n_embd=args.width, n_head=args.heads, dropout=0.1)
        opt = opsmath.optimize(model, memory_budget=budget, inductor=True)
        try:
            opt(*batch).backward()
        except opsmath.InfeasibleBudget as e:   # recorded, and the sweep goes on
            print(f"budget {text}: {e}")
            continue
        fw, bw, n_user = store[-1]
        plan = opsmath.report(opt).graphs[0].plan
        rows.append(dict(budget=text, saved_bytes=saved_bytes(fw, n_user), fwd_gemm=gemm_flops(fw),
                         bwd_gemm=gemm_flops(bw), planned_kept=plan.kept if plan else None,
                         planned_unconstrained=plan.unconstrained if plan else None,
                         modelled_recompute_s=plan.recompute_seconds if plan else 0.0,
                         segments=len(plan.chosen) if plan else 0))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--budgets", default="none,0.75,0.5,0.35")
    ap.add_argument("--smoke", action="store_true", help="tiny, nothing written")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.width, args.seq, args.batch, args.budgets = 1, 32, 16, 2, "none,0.9"
    with _capture_partitions([]) as store:
        rows = sweep(args, store)
    base = rows[0]
    print(f"GPT {args.layers}x{args.width} ({args.heads} heads), B{args.batch} T{args.seq}, Inductor on {'CUDA' if torch.cuda.is_available() else 'CPU'}")
    print(f"{'budget':>7} {'saved MiB':>9} {'planned kept':>12} {'bwd GFLOP':>9} {'recomputed GEMM':>15} {'segments':>8}")
    for r in rows:
        extra = (r["bwd_gemm"] - base["bwd_gemm"]) / (base["fwd_gemm"] + base["bwd_gemm"])
        kept = f"{r['planned_kept'] / 2**20:.1f}" if r["planned_kept"] is not None else "-"
        print(f"{r['budget']:>7} {r['saved_bytes'] / 2**20:9.1f} {kept:>12} {r['bwd_gemm'] / 1e9:9.2f} "
              f"{extra:+14.1%} {r['segments']:8d}")
    if not args.smoke:
        print("wrote", write("inductor_partition", dict(config=vars(args), rows=rows)))


if __name__ == "__main__":
    main()
