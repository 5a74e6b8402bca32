"""Where a cold first step's attention tuning goes: each fleet shape's ``backend_for`` on empty caches, profiled.

The fleet's first steps run up to 2x ``torch.compile``'s, most of it attention tuning's candidates' first calls
(BENCHMARKS.md, Fleet). This runs the tuner alone, in one process, on fresh Triton and opsmath caches, for the
attention shapes of the fleet's slow rows, and reports per shape the wall seconds, the tuning cache's per-candidate
first-call and timing seconds, the tuner's own count (``autotune.SPENT``: seconds, and of them the candidates'
first calls, the block configurations compiled ahead in threads included), and the main thread's cProfile:
the cumulative seconds of Triton's compile stages run there and the accuracy check (compiles in the tuner's
threads show only as the main thread's wait). A tiny Triton kernel is launched first so that one-time set-up
(Triton's driver utilities, CUDA context) is counted apart.

    python -m benchmarks first_call [--cases gemma2-window,gemma2,mistral-window,bert-mask,vit]
"""
from __future__ import annotations

import os
import sys
import tempfile

if "--smoke" not in sys.argv:   # empty caches, before triton reads its directory
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    os.environ["OPSMATH_CACHE_DIR"] = tempfile.mkdtemp(prefix="opsmath-cold-")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks._harness import smoke_out, write  # noqa: E402

# name: (q shape, kv heads, mask shape, causal, softcap, window), bf16, the fleet's B and T (AMP and bf16 alike)
CASES = {
    "gemma2-window": ((4, 8, 1024, 128), 4, None, True, 50.0, 512),
    "gemma2": ((4, 8, 1024, 128), 4, None, True, 50.0, 0),
    "mistral-window": ((4, 16, 1024, 64), 8, None, True, 0.0, 512),
    "bert-mask": ((16, 16, 512, 64), 16, (16, 1, 1, 512), False, 0.0, 0),
    "vit": ((32, 16, 197, 64), 16, None, False, 0.0, 0),
}
SEEN: set = set()   # tuning cache keys reported by an earlier case
# cProfile entries reported, by a substring of "file:function"
STAGES = {"triton compile": "compiler/compiler.py:compile", "front end (ast to ttir)": "make_ir",
          "ttir": "make_ttir", "ttgir": "make_ttgir", "llir": "make_llir", "ptx": "make_ptx", "ptxas": "make_cubin",
          "C builds": "_compile_so_from_src", "module loads": "_init_handles", "subprocesses": "subprocess.py:run",
          "tuning measure": "autotune.py:measure", "accuracy check": "accurate_backends", "compile ahead": "compile_ahead"}


def stages(prof: cProfile.Profile) -> dict:
    stats = pstats.Stats(prof).stats
    out = {}
    for label, key in STAGES.items():
        hits = [v[3] for (path, _, fn), v in stats.items() if key in f"{path}:{fn}" or key == fn]
        out[label] = round(max(hits), 3) if hits else 0.0   # cumulative of the outermost frame of that name
    return out


def warm_up() -> float:
    import triton
    import triton.language as tl

    @triton.jit
    def _one(x):
        tl.store(x, 1.0)
    t = time.perf_counter()
    _one[(1,)](torch.zeros(1, device="cuda"))
    torch.cuda.synchronize()
    return time.perf_counter() - t


def run_case(name: str, device: str = "cuda") -> dict:
    from opsmath.kernels.attention.tuning import backend_for
    from opsmath.kernels.autotune import SPENT, load, machine_key
    before = dict(SPENT)
    q_shape, hkv, mask_shape, causal, softcap, window = CASES[name]
    q = torch.empty(q_shape, device=device, dtype=torch.bfloat16)
    k = torch.empty(q_shape[0], hkv, q_shape[2], q_shape[3], device=device, dtype=torch.bfloat16)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    choice = backend_for(q, k, None, mask_shape, float("-inf"), causal, q_shape[3] ** -0.5, 0.0, False, softcap, window)
    prof.disable()
    seconds = time.perf_counter() - t
    entries = load().get(machine_key(), {}).get("attention", {})
    took = {key: dict(took=e.get("took"), ms=e.get("ms")) for key, e in entries.items() if key not in SEEN}
    SEEN.update(entries)
    spent = {k: round(SPENT[k] - before[k], 3) for k in ("seconds", "first_calls")}
    top = pstats.Stats(prof)
    top.sort_stats("cumulative")
    rows = sorted(((v[3], f"{os.path.basename(p)}:{ln}({fn})") for (p, ln, fn), v in top.stats.items()), reverse=True)
    return dict(choice=choice, seconds=round(seconds, 3), tuner=spent, stages=stages(prof), took=took,
                top=[(round(s, 3), f) for s, f in rows[:40]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tag", default="")
    ap.add_argument("--smoke", action="store_true", help="on the CPU (nothing is tuned there): checks the script")
    args = ap.parse_args()
    if args.smoke:
        smoke_out("first_call")
    elif not torch.cuda.is_available():
        raise SystemExit("first_call measures CUDA tuning: no GPU here")
    rows = dict(warm_up_s=0.0 if args.smoke else round(warm_up(), 3))
    print(f"one-time Triton set-up {rows['warm_up_s']} s")
    for name in args.cases.split(","):
        row = rows[name] = run_case(name, "cpu" if args.smoke else "cuda")
        print(f"{name:15s} {row['seconds']:7.2f} s -> {row['choice']}; tuner {row['tuner']['seconds']} s, "
              f"{row['tuner']['first_calls']} s of it first calls; " +
              ", ".join(f"{k} {v}" for k, v in row["stages"].items() if v))
        print("   took:", json.dumps(row["took"]))
        for s, f in row["top"][:25]:
            print(f"   {s:8.3f}  {f}")
    print("wrote", write("first_call" + (f"-{args.tag}" if args.tag else ""), dict(args=vars(args), rows=rows)))


if __name__ == "__main__":
    main()
