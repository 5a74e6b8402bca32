"""Where a cold first training step goes: one fleet model's first step under ``torch.compile`` and under
``opsmath.optimize``, each in a fresh process on empty Inductor, Triton and opsmath caches, profiled.

The fleet (``benchmarks/fleet.py``) measures each variant's first step; this splits it. Per variant: the
first step's forward, backward and optimizer wall seconds (the device waited for), and the main thread's
cProfile cumulative seconds of the stages that the two share or that opsmath adds: dynamo's tracing
(``convert_frame._compile``, which includes the backend), opsmath's lowering to ATen, its fake-tensor
liveness runs, its pattern pass and planning, Inductor's forward and backward compiles (AOTAutograd's
backward compile runs at the first backward), Triton compiles run in the main thread and opsmath's
tuning. Inductor's parallel compile workers show only as the main thread's waits. cProfile slows Python
(dynamo's tracing most), so its seconds are shares, and the unprofiled wall of each phase is given beside.

    python -m benchmarks first_step [--models mistral,gemma2] [--recipe amp] [--variants ...]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

from benchmarks import ROOT

# stage: (file suffix, function name): the cumulative seconds of these calls, summed over calls
STAGES = {
    "dynamo (backend included)": ("convert_frame.py", "_compile"),
    "opsmath backend": ("opsmath/runtime/backend.py", "compile_graph"),
    "opsmath lowering": ("opsmath/capture/lower.py", "lower_to_aten"),
    "opsmath liveness": ("opsmath/memory/analysis.py", "saved_bytes_by_node"),
    "opsmath patterns": ("opsmath/rewrite/match.py", "run_patterns"),
    "opsmath planning": ("opsmath/runtime/backend.py", "plan_graph"),
    "opsmath tuning": ("opsmath/kernels/autotune.py", "tune"),
    "Inductor compile_fx": ("torch/_inductor/compile_fx.py", "compile_fx"),
    "Inductor graphs (fwd + bwd)": ("torch/_inductor/compile_fx.py", "compile_fx_inner"),
    "Triton compile (main thread)": ("triton/compiler/compiler.py", "compile"),
    "user Triton kernels' TTIR analysis": ("_higher_order_ops/triton_kernel_wrap.py", "identify_accessed_tensors"),
    "waits on compile workers": ("concurrent/futures/_base.py", "result"),
}


def stage_seconds(stats: pstats.Stats) -> dict:
    """Cumulative seconds per ``STAGES`` entry (outermost calls only: recursion is not double counted)."""
    out = dict.fromkeys(STAGES, 0.0)
    for (path, _, func), (_, _, _, cum, _) in stats.stats.items():
        for stage, (suffix, name) in STAGES.items():
            if func == name and path.replace(os.sep, "/").endswith(suffix):
                out[stage] += cum
    return {k: round(v, 2) for k, v in out.items()}


def child(model: str, recipe: str, variant: str, profile: bool) -> dict:
    """One variant's first step in this (fresh) process: phases, wall, and the profile's stages."""
    import torch
    from benchmarks.fleet import VARIANTS, FleetVariant, build, inputs
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
        stats = pstats.Stats(prof)
        out["stages_s"] = stage_seconds(stats)
        out["top"] = top_entries(stats)
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
           "--variants", variant] + (["--no-profile"] if not profile else []) + (["--smoke"] if smoke else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("FIRST_STEP "):
            return json.loads(line[len("FIRST_STEP "):])
    return dict(model=model, recipe=recipe, variant=variant, error=done.stderr[-2000:])


def report(r: dict) -> None:
    if "error" in r:
        print(f"{r['model']} {r['variant']}: failed\n{r['error']}", flush=True)
        return
    phases = ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in r["phases"].items())
    print(f"{r['model']:8} {r['recipe']} {r['variant']:17} first step {r['first_step_s']:6.1f} s"
          f"{' (profiled)' if r['profiled'] else ''}: {phases}", flush=True)
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
    ap.add_argument("--no-profile", action="store_true", help="the unprofiled first steps only")
    ap.add_argument("--profile-only", action="store_true", help="the profiled first steps only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="tiny models on CPU: checks the script")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.child:
        print("FIRST_STEP " + json.dumps(child(args.models, args.recipe, args.variants, not args.no_profile)))
        return
    from benchmarks._harness import smoke_out, write
    if args.smoke:
        smoke_out("first_step")
    rows = []
    for model in args.models.split(","):
        for variant in args.variants.split(","):
            for profile in [False] * (not args.profile_only) + [True] * (not args.no_profile):
                rows.append(spawn(model, args.recipe, variant, profile, args.smoke))
                report(rows[-1])
    print("wrote", write(f"first_step-{args.recipe}{args.tag}", dict(rows=rows)))


if __name__ == "__main__":
    main()
