"""What a memory budget costs a training step, taken apart: wall time, host (enqueue) time and GPU kernel
time per step, for GPT-2-small (nanoGPT, B8 T1024, bf16 autocast, fused AdamW) or with ``--model llama``
HF LLaMA 1.1B (``_models.llama_config``, SDPA, fp32 weights, bf16 autocast, B4 T2048), without a budget
and under fractional budgets, each with and without CUDA-graph replay, interleaved in one process;
with ``--anchors`` also ``torch.compile`` unconstrained and with ``activation_memory_budget`` at each
budget, PyTorch's own lever, in the same rounds.

* ``wall``: step start to ``synchronize`` (median over rounds of the median of ``--steps`` steps).
* ``host``: step start until ``step()`` returns, before the sync: the CPU's own time to enqueue the step
  (when it exceeds the GPU time, the step is host-bound and the host time is the step time).
* ``gpu``: summed kernel time per step (torch.profiler), what the step costs a GPU kept busy.
* ``--cprofile``: the host's Python profile (cProfile, top functions by total time) of a few steps of
  one variant, to see where a host-bound step's time goes.

    python -m benchmarks recompute_overhead --budgets 0.5,0.25 --cprofile "budget 0.5"
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch

import opsmath
from benchmarks._harness import interleave, kernel_ms, write
from benchmarks._models import GPT2_SMALL, build, build_llama, gpt2_batch


def _inductor_under(budget):
    """Inductor with ``activation_memory_budget=budget`` while it partitions. A backend object of its own:
    dynamo reuses a compiled frame for any equal backend, and ``torch.compile(model)`` of a second instance
    of the same class would run the first anchor's graph (its partition, whatever the config says)."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)
    return backend


class Variant:
    """One way to train the model, built and warmed up. ``anchor`` (a fraction, 1.0 for none): plain
    ``torch.compile`` of the SDPA model with ``torch._functorch.config.activation_memory_budget`` set
    while it compiles (the partitioner reads it when the joint graph is split), instead of opsmath."""

    def __init__(self, name, budget, cuda_graphs, batch, llama=False, measured=False, steps="all", anchor=None,
                 offload=True, env=None):
        self.name, self.batch, self.wall, self.host = name, batch, [], []
        model = build_llama({}, "cuda", "eager") if llama else build(GPT2_SMALL, "cuda", "eager")
        # read when a graph is planned (and re-planned, in the warm-up steps)
        env = {"OPSMATH_MEASURED_COSTS": "1" if measured else "0", "OPSMATH_CHEAP_STEPS": "0" if steps == "none" else "1",
               "OPSMATH_TENSOR_STEPS": "1" if steps == "all" else "0", "OPSMATH_OFFLOAD": "1" if offload else "0",
               **(env or {})}
        os.environ.update(env)
        try:
            self.model = (torch.compile(model, backend=_inductor_under(anchor)) if anchor is not None else
                          opsmath.optimize(model, memory_budget=budget, cuda_graphs=cuda_graphs))
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
            for _ in range(5):   # capture, plan, compile, CUDA-graph recording, optimizer state
                self.step()
        finally:
            for k in env:
                os.environ.pop(k)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self.step()
        torch.cuda.synchronize()
        self.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        self.step_peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30

    def step(self):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.model(*self.batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed_round(self, steps, accumulate=1):
        """``steps`` steps, synchronized before and after each: their median wall and host (enqueue) ms."""
        wall, host = [], []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.step()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            wall.append((time.perf_counter() - t0) * 1e3)
            host.append((t1 - t0) * 1e3)
        self.wall.append(statistics.median(wall))
        self.host.append(statistics.median(host))

    def row(self):
        graphs = opsmath.report(self.model).graphs if hasattr(self.model, "_opsmath") else []
        plans = [g.plan.to_dict() for g in graphs if g.plan is not None]
        per = kernel_ms(self.step, calls=3)
        copies = {k: v for k, v in per.items() if k.startswith("Memcpy")}   # host copies (offload) apart
        return dict(name=self.name, copies_ms=copies, gpu_compute_ms=sum(per.values()) - sum(copies.values()),
                    wall_ms=statistics.median(self.wall), wall_min=min(self.wall),
                    wall_max=max(self.wall), host_ms=statistics.median(self.host),
                    gpu_ms=sum(per.values()), peak_gib=self.peak_gib,
                    step_peak_gib=self.step_peak_gib, rounds=self.wall,
                    plans=[{k: p.get(k) for k in ("budget", "budget_bytes", "budget_share", "unconstrained", "kept",
                                                  "predicted_peak", "expected_peak", "measured_peak", "excess",
                                                  "head_excess", "recompute_seconds", "measured_ops", "chosen", "selective",
                                                  "casts", "tensors", "offloaded", "offloaded_bytes")}
                           for p in plans])


def _built(label, *args, **kw):
    """``Variant(label, ...)``, or None with the error printed (the other variants still run)."""
    try:
        t0 = time.perf_counter()
        v = Variant(label, *args, **kw)
        print(f"{label}: built and warmed up in {time.perf_counter() - t0:.0f} s", flush=True)
        return v
    except Exception as e:  # noqa: BLE001
        print(f"{label}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None


def host_profile(v: Variant) -> str:
    """cProfile of three steps of ``v``: the 25 functions with the most time of their own."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        v.step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    return s.getvalue()


def build_variants(args, batch, llama: bool) -> list:
    """Every variant ``args`` asks for, built and warmed up (None where building failed)."""
    budgets = [b for b in args.budgets.split(",") if b]
    specs = [("no budget", None, False, "all")] + [(f"budget {b}", float(b), False, "all") for b in budgets
                                                     if not args.measured_only]
    if args.measured_costs or args.measured_only:   # the same budgets planned from each op's time measured on the GPU (op_times)
        specs += [(f"budget {b} (measured costs)", float(b), True, "all") for b in budgets]
    m = args.measured_costs or args.measured_only
    for flag, steps, what in ((args.without_tensor_steps, "cheap", "tensor"), (args.without_cheap_steps, "none", "cheap")):
        if flag:
            specs += [(f"budget {b} ({'measured costs, ' if m else ''}without {what} steps)", float(b), m, steps)
                      for b in budgets]
    graphs = (False,) if args.no_cuda_graphs else (True,) if args.cuda_graphs_only else (False, True)
    variants = [_built(name + (" + CUDA graphs" if cg else ""), budget, cg, batch, llama, measured, steps)
                for cg in graphs for name, budget, measured, steps in specs]
    if args.without_offload:
        variants += [_built(f"budget {b} (without offload)", float(b), False, batch, llama, offload=False)
                     for b in budgets]
    for flag, var, what in ((args.offload_exposed, "OPSMATH_OFFLOAD_EXPOSED", "copies priced at"),
                            (args.offload_margins, "OPSMATH_OFFLOAD_MARGIN", "offload margin")):
        variants += [_built(f"budget {b} ({what} {m})", float(b), False, batch, llama, env={var: m})
                     for m in flag.split(",") if m for b in budgets]
    if args.anchors:
        variants += [_built("torch.compile" + (f", activation_memory_budget={f}" if f < 1 else ""),
                            None, False, batch, llama, anchor=f)
                     for f in [1.0] + [float(b) for b in args.anchors.split(",")]]
    return variants


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="0.5,0.25")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="only the variants without CUDA graphs")
    ap.add_argument("--cuda-graphs-only", action="store_true", help="only the variants with CUDA graphs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cprofile", default="", help="variant name whose host time cProfile takes apart")
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    ap.add_argument("--measured-costs", action="store_true",
                    help="each budget also planned with OPSMATH_MEASURED_COSTS=1 (op times measured on the GPU)")
    ap.add_argument("--without-cheap-steps", action="store_true",
                    help="each budget also planned with OPSMATH_CHEAP_STEPS=0 (no weight copies or selective-free "
                         "runs), with measured costs where --measured-costs")
    ap.add_argument("--without-tensor-steps", action="store_true",
                    help="each budget also planned with OPSMATH_TENSOR_STEPS=0 (no selective-tensors runs)")
    ap.add_argument("--without-offload", action="store_true",
                    help="each budget also planned with OPSMATH_OFFLOAD=0 (recompute only, no host copies)")
    ap.add_argument("--offload-exposed", default="",
                    help="e.g. 0.05: each budget also planned with offload's copies priced at that share of their time "
                         "(OPSMATH_OFFLOAD_EXPOSED)")
    ap.add_argument("--offload-margins", default="",
                    help="e.g. 1.5,2: each budget also planned and placed with OPSMATH_OFFLOAD_MARGIN at each")
    ap.add_argument("--measured-only", action="store_true", help="the budgets planned with measured costs only")
    ap.add_argument("--anchors", default="",
                    help="fractions, e.g. 0.5,0.25: also torch.compile of the SDPA model, unconstrained and with "
                         "activation_memory_budget at each (no CUDA graphs), in the same rounds")
    args = ap.parse_args()
    llama = args.model == "llama"
    batch = gpt2_batch(B=4, T=2048) if llama else gpt2_batch()
    if llama:   # token ids of LLaMA's vocabulary
        batch = tuple(t.remainder(32000) for t in batch)
    # one reset for all variants: a reset per variant drops the earlier variants' compiled code, which
    # would then recompile in the first timed round
    torch._dynamo.reset()
    variants = build_variants(args, batch, llama)
    variants = [v for v in variants if v is not None]
    interleave(variants, args.rounds, args.steps,   # A B A B: the host's noise falls on every variant
               after_round=lambda i: print(f"round {i}: " + ", ".join(f"{v.name} {v.wall[-1]:.2f}" for v in variants),
                                           flush=True))
    rows = [v.row() for v in variants]
    base = {cg: next((r for r in rows if r["name"] == "no budget" + cg), None) for cg in ("", " + CUDA graphs")}
    base["torch.compile"] = next((r for r in rows if r["name"] == "torch.compile"), None)
    for r in rows:   # an anchor's overhead is against torch.compile unconstrained
        b = base["torch.compile" if r["name"].startswith("torch.compile")
                 else " + CUDA graphs" if r["name"].endswith("CUDA graphs") else ""]
        if b is not None:
            r["wall_overhead"], r["gpu_overhead"] = r["wall_ms"] / b["wall_ms"] - 1, r["gpu_ms"] / b["gpu_ms"] - 1
        print(f"{r['name']:60} wall {r['wall_ms']:7.2f} ms [{r['wall_min']:.2f}-{r['wall_max']:.2f}] "
              f"host {r['host_ms']:7.2f} gpu {r['gpu_ms']:7.2f} (copies {sum(r['copies_ms'].values()):.2f}) peak {r['peak_gib']:.2f} step peak {r['step_peak_gib']:.2f} GiB"
              + (f"  overhead wall {r['wall_overhead']:+.1%} gpu {r['gpu_overhead']:+.1%}" if b else ""), flush=True)
    out = dict(rows=rows, model=args.model, config="llama_config" if llama else GPT2_SMALL,
               batch=[4, 2048] if llama else [8, 1024])
    from opsmath.runtime import offload_async
    out["placements"] = [dict(tensors=len(p.names), gib=p.nbytes / 2**30, late=p.late, late_tensors=p.late_tensors,
                              input_casts=p.input_casts)
                         for p in offload_async.placements]
    print("offload placements:", out["placements"], flush=True)
    for v in variants:
        if v.name == args.cprofile:
            out["cprofile"] = host_profile(v)
            print(out["cprofile"])
    print("wrote", write("recompute_overhead" + ("-llama" if llama else ""), out))


if __name__ == "__main__":
    main()
