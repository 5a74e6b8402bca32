"""Where a cold first training step goes: one fleet model's first step under ``torch.compile`` and under
``opsmath.optimize``, each in a fresh process on empty Inductor, Triton and opsmath caches, split by stage.

The fleet (``benchmarks/fleet.py``) measures each variant's first step; this splits it. Per variant: the
first step's forward, backward and optimizer wall seconds (the device waited for), and the inclusive
seconds of the stages the two share or that opsmath adds, timed by wrappers around their functions
(``TIMED``; a call inside another call of the same stage counts once): dynamo's frame compiles (its backend
included), opsmath's backend and within it the lowering to ATen, the pattern pass, the fake-tensor
liveness runs and its call of Inductor; Inductor's graph compiles, forward and backward (AOTAutograd
compiles the backward at the first backward); the TTIR analysis of user Triton kernels that Inductor and
AOTAutograd trace into (attention's ``triton_op``s); opsmath's tuning (``autotune.SPENT``). Inductor's
parallel compile workers show only inside the stage that waits for them. ``--profile`` adds a run under
cProfile (about twice as slow) with its largest cumulative entries.

    python -m benchmarks first_step [--models mistral,gemma2] [--recipe amp] [--variants ...] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

from benchmarks import ROOT
from benchmarks.triton_caches import summarize

# stage: (module, function) wrapped by ``_timed``; Inductor's graph compiles are told apart by ``is_backward``
TIMED = {
    "dynamo (backend included)": ("torch._dynamo.convert_frame", "_compile"),
    "opsmath backend": ("opsmath.runtime.backend", "compile_graph"),
    "opsmath lowering": ("opsmath.runtime.backend", "lower_to_aten"),
    "opsmath patterns": ("opsmath.runtime.backend", "run_patterns"),
    "opsmath liveness": ("opsmath.runtime.backend", "saved_bytes_by_node"),
    "opsmath liveness (report)": ("opsmath.memory.analysis", "saved_bytes_by_node"),
    "Inductor, opsmath's call": ("opsmath.runtime.backend", "compile_fx"),
    "Inductor graph": ("torch._inductor.compile_fx", "_compile_fx_inner"),
    "user Triton kernels' TTIR analysis": ("torch._higher_order_ops.triton_kernel_wrap", "identify_accessed_tensors"),
}
ALIASES = {"identify_accessed_tensors": ("identify_mutated_tensors",)}   # torch's older name (2.11)
SECONDS: dict = {}


def _timed(stage: str, fn):
    """``fn`` adding its inclusive seconds to ``SECONDS[stage]`` (Inductor's graphs: forward or backward)."""
    depth = [0]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if depth[0]:
            return fn(*args, **kwargs)
        depth[0], t = 1, time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            depth[0] = 0
            label = stage + (" backward" if kwargs.get("is_backward") else " forward") \
                if stage == "Inductor graph" else stage
            SECONDS[label] = SECONDS.get(label, 0.0) + time.perf_counter() - t
    return wrapper


def install_timers() -> None:
    for stage, (module, name) in TIMED.items():
        mod = importlib.import_module(module)
        name = next((n for n in (name, *ALIASES.get(name, ())) if hasattr(mod, n)), None)
        if name is not None:
            setattr(mod, name, _timed(stage, getattr(mod, name)))


def child(model: str, recipe: str, variant: str, profile: bool) -> dict:
    """One variant's first step in this (fresh) process: phases, wall, the stages' seconds (timers, or with
    ``profile`` cProfile's largest entries)."""
    import torch
    from benchmarks.fleet import VARIANTS, FleetVariant, build, inputs
    from opsmath.kernels import autotune
    from opsmath.runtime import ttir_cache
    if not profile:
        install_timers()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = device == "cpu"
    torch.empty(1, device=device)   # the device context, not a phase of the step
    net = build(model, recipe, device, smoke)
    batch, shape = inputs(model, net, device, smoke)
    v = FleetVariant(variant, VARIANTS[variant](net), batch, device, recipe)
    prof = cProfile.Profile() if profile else None
    v._start = t0 = time.perf_counter()
    if prof:
        prof.enable()
    v.step()
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    out = dict(model=model, recipe=recipe, variant=variant, shape=shape, profiled=profile,
               first_step_s=round(wall, 2), phases=v.phases)
    if prof:
        out["top"] = top_entries(pstats.Stats(prof))
    else:
        out["stages_s"] = {k: round(v, 2) for k, v in SECONDS.items()}
        out["stages_s"]["opsmath tuning"] = round(autotune.SPENT["seconds"], 2)
        out["ttir_analyses"] = dict(ttir_cache.STATS)   # opsmath's kernels: analyzed (misses), served (hits)
    return out


def top_entries(stats: pstats.Stats, n: int = 40) -> list[str]:
    """The ``n`` largest cumulative entries of opsmath, Inductor, AOTAutograd and Triton, as lines."""
    keep = ("opsmath/", "_inductor/", "_functorch/", "triton/", "_dynamo/convert_frame", "_higher_order_ops/")
    rows = [(cum, f"{os.path.basename(path)}:{line}({func})") for (path, line, func), (_, _, _, cum, _)
            in stats.stats.items() if any(k in path.replace(os.sep, "/") for k in keep)]
    return [f"{cum:8.2f}  {name}" for cum, name in sorted(rows, reverse=True)[:n]]


def spawn(model: str, recipe: str, variant: str, profile: bool, smoke: bool) -> dict:
    """``child`` in a new process with empty caches (Inductor's, Triton's, opsmath's)."""
    cold = tempfile.mkdtemp(prefix="first-step-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cold, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cold, "triton"), OPSMATH_CACHE_DIR=os.path.join(cold, "opsmath"))
    cmd = [sys.executable, "-m", "benchmarks", "first_step", "--child", "--models", model, "--recipe", recipe,
           "--variants", variant] + (["--profile"] if profile else []) + (["--smoke"] if smoke else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("FIRST_STEP "):
            # kernels the cold Triton cache holds twice: compiles the first step paid twice
            return dict(json.loads(line[len("FIRST_STEP "):]), triton_cache=summarize(env["TRITON_CACHE_DIR"]))
    return dict(model=model, recipe=recipe, variant=variant, error=done.stderr[-2000:])


def report(r: dict) -> None:
    if "error" in r:
        print(f"{r['model']} {r['variant']}: failed\n{r['error']}", flush=True)
        return
    phases = ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in r["phases"].items())
    print(f"{r['model']:8} {r['recipe']} {r['variant']:17} first step {r['first_step_s']:6.1f} s"
          f"{' (profiled)' if r['profiled'] else ''}: {phases}", flush=True)
    cache = r.get("triton_cache")
    if cache:
        print(f"    Triton cache: {cache['entries']} entries of {cache['kernels']} kernels, "
              f"{len(cache['twice'])} of them compiled more than once", flush=True)
        for name, diffs in list(cache["twice"].items())[:8]:
            print(f"      {name}: " + " | ".join("; ".join(d[:3]) for d in diffs), flush=True)
    if "ttir_analyses" in r:
        print(f"    TTIR analyses of opsmath's kernels: {r['ttir_analyses']}", flush=True)
    for stage, s in r.get("stages_s", {}).items():
        if s:
            print(f"    {stage:30} {s:7.2f} s", flush=True)
    for line in r.get("top", []):
        print("      " + line, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mistral,gemma2")
    ap.add_argument("--recipe", choices=["amp", "bf16"], default="amp")
    ap.add_argument("--variants", default="torch.compile,opsmath.optimize")
    ap.add_argument("--profile", action="store_true", help="also a run under cProfile per variant")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="tiny models on CPU: checks the script")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.child:
        print("FIRST_STEP " + json.dumps(child(args.models, args.recipe, args.variants, args.profile)))
        return
    from benchmarks._harness import smoke_out, write
    if args.smoke:
        smoke_out("first_step")
    rows = []
    for model in args.models.split(","):
        for variant in args.variants.split(","):
            for profile in [False, True][:1 + args.profile]:
                rows.append(spawn(model, args.recipe, variant, profile, args.smoke))
                report(rows[-1])
    print("wrote", write(f"first_step-{args.recipe}{args.tag}", dict(rows=rows)))


if __name__ == "__main__":
    main()
