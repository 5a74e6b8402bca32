"""Rewrite families, one file each: importing the package imports every pattern file, which registers
its rule (``opsmath.rewrite.rules.register_rule``). ``ALL`` is the order the driver applies them in: every
rule's ``after`` constraint honoured, ties in file order."""
import importlib
import pkgutil

from opsmath.rewrite.rules import RULES, ordered

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")

ALL = ordered(RULES)
NAMES = [p.name for p in ALL]
