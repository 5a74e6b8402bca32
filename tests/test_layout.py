"""The package's shape, as docs/design.md describes it: one folder per pipeline stage, imports only
from the same or an earlier stage, no import cycle, no folder past 20 modules, no file past 400 lines,
no function past 80. Reads the source with ``ast``; imports nothing from opsmath."""
import ast
import os

import networkx as nx

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
# earlier stages first; the user-facing layer (ui/ and the top-level api, dynamo_backend, examples and
# name shims) comes last
TOP = 9
STAGES = {"meta_keys": 0, "kernels": 0, "optim": 1, "capture": 1, "rewrite": 2, "patterns": 3, "memory": 4,
          "runtime": 5, "ui": TOP}


def _modules() -> dict[str, str]:
    mods = {}
    for d, _, files in os.walk(SRC):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()
TREES = {m: ast.parse(open(p).read()) for m, p in MODULES.items()}


def _imports(module: str) -> set[str]:
    package = module if MODULES[module].endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n in MODULES and n != module}
    return found


EDGES = [(m, t) for m in MODULES for t in _imports(m)]


def _stage(module: str) -> int:
    parts = module.split(".")
    return STAGES.get(parts[1], TOP) if len(parts) > 1 else TOP


def test_no_import_cycle():
    cycles = [c for c in nx.strongly_connected_components(nx.DiGraph(EDGES)) if len(c) > 1]
    assert not cycles


def test_stages_import_only_earlier_stages():
    backwards = [(a, b) for a, b in EDGES if _stage(b) > _stage(a)]
    assert not backwards


def test_kernels_depend_only_on_torch_and_triton():
    outside = [(a, b) for a, b in EDGES if a.startswith("opsmath.kernels") and not b.startswith("opsmath.kernels")]
    assert not outside


def test_no_folder_past_20_modules():
    folders = {}
    for path in MODULES.values():
        folders.setdefault(os.path.dirname(path), []).append(path)
    assert not {d: len(f) for d, f in folders.items() if len(f) > 20}


def test_no_file_past_400_lines_no_function_past_80():
    long_files = {m: n for m, p in MODULES.items() if (n := len(open(p).read().splitlines())) > 400}
    long_functions = [(m, f.name, f.end_lineno - f.lineno + 1) for m, tree in TREES.items() for f in ast.walk(tree)
                      if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno >= 80]
    assert not long_files and not long_functions
