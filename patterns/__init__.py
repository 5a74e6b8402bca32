"""Rewrite families, one file each. ``ALL`` is the order the driver applies them in."""
from .attention import PATTERN as ATTENTION
from .norms import PATTERN as DROPOUT_ADD_NORM

ALL = [ATTENTION, DROPOUT_ADD_NORM]
NAMES = [p.name for p in ALL]
