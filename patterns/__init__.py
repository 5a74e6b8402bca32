"""Rewrite families, one file each. ``ALL`` is the order the driver applies them in."""
from .attention import PATTERN as ATTENTION
from .bias_gelu import PATTERN as BIAS_GELU
from .cross_entropy import PATTERN as CROSS_ENTROPY
from .linear_cross_entropy import PATTERN as LINEAR_CROSS_ENTROPY
from .norms import PATTERN as DROPOUT_ADD_NORM
from .softmax import PATTERN as SCALED_SOFTMAX
from .swiglu import PATTERN as SWIGLU

ALL = [ATTENTION, DROPOUT_ADD_NORM, LINEAR_CROSS_ENTROPY, CROSS_ENTROPY,   # cross_entropy takes what LCE left
       SWIGLU, BIAS_GELU, SCALED_SOFTMAX]   # scaled_softmax takes the softmaxes attention left
NAMES = [p.name for p in ALL]
