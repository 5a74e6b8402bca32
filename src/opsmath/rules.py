"""``opsmath.rules`` is ``opsmath.rewrite.rules`` (the name rules written outside opsmath import)."""
import sys

from opsmath.rewrite import rules as _module

sys.modules[__name__] = _module
