"""Fused ops, one file each: Triton forward + backward, launcher, ``torch.library`` custom op, the
PyTorch reference that CPU tensors run and tests compare against, and the op's spec (``_spec.OpSpec``:
cost model, Inductor policy, profiler names, launch coverage). Importing the package imports every
kernel file, which registers every ``opsmath::`` op and fills ``SPECS``. This package depends only on
torch and triton (and rich for the tuning progress bar).

The submodules keep their names (``opsmath.kernels.attention`` is the module): the convenience
functions of the same name live in them, e.g. ``opsmath.kernels.attention.attention``.
"""
import importlib
import pkgutil

from opsmath.kernels._spec import SPECS, OpSpec, spec_of  # noqa: F401

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")
