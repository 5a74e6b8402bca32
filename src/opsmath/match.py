"""``opsmath.match`` is ``opsmath.rewrite.match`` (the name rules written outside opsmath import)."""
import sys

from opsmath.rewrite import match as _module

sys.modules[__name__] = _module
