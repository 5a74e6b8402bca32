"""``python -m benchmarks NAME [args...]``: run ``benchmarks/NAME.py`` as ``__main__`` with ``args``;
without NAME, list the benchmarks by family.

With ``--smoke`` (toy sizes on CPU, measuring nothing: ``tests/test_benchmarks_smoke.py``) the
``torch.compile`` anchors compile with ``backend="aot_eager"``: AOTAutograd's capture and partition
without Inductor's C++ codegen, which took most of the smoke runs' time (about 3-4 s a kernel). A smoke
run checks the script, not Inductor; opsmath's own variants compile as they would."""
from __future__ import annotations

import runpy
import sys

from benchmarks import listing, names


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    name = argv[0].removesuffix(".py")
    if name not in names():
        print(f"no benchmark {argv[0]!r}\n\n{listing()}", file=sys.stderr)
        return 2
    if "--smoke" in argv:
        smoke_compile()
    sys.argv = [name, *argv[1:]]   # run_module sets argv[0] to the module's file
    runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    return 0


def smoke_compile() -> None:
    """``torch.compile`` with ``backend="aot_eager"`` where a benchmark names no backend (module doc)."""
    import functools
    import torch
    real = torch.compile

    @functools.wraps(real)
    def compile(model=None, **kwargs):
        kwargs.setdefault("backend", "aot_eager")
        if kwargs["backend"] == "aot_eager":
            kwargs.pop("mode", None)
            kwargs.pop("options", None)
        return real(model, **kwargs) if model is not None else real(**kwargs)
    torch.compile = compile


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
