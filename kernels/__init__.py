"""Fused ops, one file each: Triton forward + backward, launcher, ``torch.library`` custom op and the
PyTorch reference that CPU tensors run and tests compare against. Importing the package registers
every ``opsmath::`` op. The submodules keep their names (``opsmath.kernels.attention`` is the module):
the convenience functions of the same name live in them, e.g. ``opsmath.kernels.attention.attention``."""
from . import (adamw, attention, attention_tuning, bias_gelu, cross_entropy, dropout_add_norm,  # noqa: F401
               linear_cross_entropy, softmax, swiglu)
from .attention import attention_op, attention_reference  # noqa: F401
from .dropout_add_norm import dropout_add_norm_op, dropout_add_norm_reference  # noqa: F401
from .cross_entropy import cross_entropy_op  # noqa: F401
from .linear_cross_entropy import linear_cross_entropy_op  # noqa: F401
