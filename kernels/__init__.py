"""Fused ops, one file each: Triton forward + backward, launcher, ``torch.library`` custom op and the
PyTorch reference that CPU tensors run and tests compare against."""
from .attention import attention, attention_op, attention_reference  # noqa: F401
from .dropout_add_norm import dropout_add_norm, dropout_add_norm_op, dropout_add_norm_reference  # noqa: F401
from .linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_op  # noqa: F401
