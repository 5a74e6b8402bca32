"""``opsmath.canonicalize`` is ``opsmath.rewrite.canonicalize`` (the name rules written outside opsmath import)."""
import sys

from opsmath.rewrite import canonicalize as _module

sys.modules[__name__] = _module
