"""opsmath's benchmarks, one module each: ``python -m benchmarks NAME [args...]`` runs ``benchmarks/NAME.py``
as a script, ``python -m benchmarks`` lists them by family. Run from the repository root; results go to
``$OUT`` (or ``benchmarks/results``) through ``benchmarks._harness.write``."""
from __future__ import annotations

import ast
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

FAMILIES = {  # family: its modules, in the order the listing shows them
    "kernels": ["attention", "attention_variants", "linear_cross_entropy", "cross_entropy", "dropout_add_norm",
                "activations", "optimizer", "grouped_gemm", "table_gather"],
    "training steps": ["train", "hf_default_attention", "hf_trainer", "moe", "fleet", "varying_lengths", "cuda_graph_loops"],
    "memory": ["memory", "card", "recompute_overhead", "plan_estimate"],
    "planner (CPU)": ["plan_partition", "inductor_partition", "plan_floors", "plan_time"],
    "numerics": ["learning_curve", "fp8_curve"],
    "coverage (CPU)": ["hf_coverage", "hf_coverage_wide", "hf_moe_coverage", "timm_coverage", "diffusers_coverage",
                       "library_coverage"],
    "multi-GPU": ["multi_gpu"],
    "tools": ["first_step", "first_call", "triton_caches", "peak_snapshot", "profile_step", "profile_gap",
              "profile_offload", "sass_stats"],
}


def names() -> list[str]:
    """Every benchmark module: the ``.py`` files of this folder but the package's own and ``_``-prefixed ones."""
    return sorted(f[:-3] for f in os.listdir(HERE) if f.endswith(".py") and not f.startswith("_"))


def summary(name: str) -> str:
    """The first line of the module's docstring, read from its source (nothing is imported)."""
    with open(os.path.join(HERE, name + ".py")) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def listing() -> str:
    """The benchmarks by family, each with its summary; a module no family names is listed under "other"."""
    have = names()
    groups = {family: [n for n in mods if n in have] for family, mods in FAMILIES.items()}
    groups["other"] = [n for n in have if not any(n in mods for mods in FAMILIES.values())]
    width = max(map(len, have), default=0)
    lines = ["python -m benchmarks NAME [args...]   (NAME --help for its options)"]
    for family, mods in groups.items():
        if mods:
            lines += ["", family + ":"] + [f"  {n:{width}}  {summary(n)}" for n in mods]
    return "\n".join(lines)


def command(name: str, *args: str) -> list[str]:
    """The argv that runs benchmark ``name`` in a child process (with ``cwd=ROOT``)."""
    return [sys.executable, "-m", "benchmarks", name, *args]
