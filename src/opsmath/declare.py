"""``opsmath.declare`` is ``opsmath.rewrite.declare`` (the name rules written outside opsmath import)."""
import sys

from opsmath.rewrite import declare as _module

sys.modules[__name__] = _module
