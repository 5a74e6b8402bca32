"""``python -m benchmarks NAME [args...]``: run ``benchmarks/NAME.py`` as ``__main__`` with ``args``;
without NAME, list the benchmarks by family."""
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
    sys.argv = [name, *argv[1:]]   # run_module sets argv[0] to the module's file
    runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
