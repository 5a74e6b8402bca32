"""One TTIR analysis per distinct launch of opsmath's Triton kernels while Inductor compiles.

AOTAutograd (functionalizing a ``triton_op``'s ``wrap_triton`` launch) and Inductor (lowering it to a
user-defined Triton kernel) each ask ``torch._higher_order_ops.triton_kernel_wrap`` which of the kernel's
tensors it reads and writes. Each ask builds the kernel's TTIR with Triton's front end (about 0.05 s for
attention's kernels on a server core) and walks it; nothing is cached, so a model with L attention layers
pays 2 x 3 x L of them in its first step (forward, dQ and dK/dV kernels).

The analysis is a pure function of the kernel, the dtypes of its tensor arguments (``generate_ttir``
replaces every fake tensor and ``TensorBox`` by a 2-element tensor of the same dtype), the values of its
other arguments (symbolic sizes all become 2) and the TMA metadata. That tuple, each tensor argument's
type beside its dtype (an IR node of another kind reaches the analysis as it is; a launch with a real
tensor is not cached), is the key here, so a cached answer is the answer the analysis would give. Only
kernels defined in opsmath are cached: a user's kernels keep torch's path. Each call returns a deep copy,
as a fresh analysis would."""
from __future__ import annotations

import copy
import functools
import threading

import torch

NAMES = ("identify_accessed_tensors", "identify_mutated_tensors")   # torch's name, by version
STATS = {"hits": 0, "misses": 0}
_LOCK = threading.Lock()
_installed = False


def _jit_function(kernel):
    """The ``JITFunction`` the analysis reads: ``kernel`` itself, or the one an ``Autotuner`` holds; ``None``
    for any other wrapper (the analysis takes only these two)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    if isinstance(kernel, Autotuner):
        kernel = getattr(kernel, "fn", None)
    return kernel if isinstance(kernel, JITFunction) else None


def _ours(kernel) -> bool:
    jit = _jit_function(kernel)
    return jit is not None and getattr(jit.fn, "__module__", "").startswith("opsmath.")


def _value_key(v):
    """What the TTIR analysis sees of one argument, hashable; ``None`` where unknown (no caching)."""
    import sympy
    from torch._subclasses.fake_tensor import FakeTensor
    if isinstance(v, FakeTensor):
        return ("T", v.dtype, "FakeTensor")
    if isinstance(v, torch.Tensor):   # a real tensor reaches Triton as it is (its alignment specializes)
        return None
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
        return ("S",)
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype)):
        return (type(v).__name__, v)
    get_dtype = getattr(v, "get_dtype", None)    # Inductor's TensorBox (and any other IR node)
    if callable(get_dtype):
        return ("T", get_dtype(), type(v).__name__)
    return None


def _kernel_key(kernel) -> tuple | None:
    """The kernel as the analysis reads it. ``wrap_triton(...)[grid](..., num_warps=w, num_stages=s)`` wraps
    the ``JITFunction`` in a new one-config ``Autotuner`` at every launch: the analysis takes its first
    config's keyword arguments and its ``fn`` (launch options such as ``num_warps`` do not reach TTIR)."""
    jit = _jit_function(kernel)
    if jit is None:
        return None
    configs = getattr(kernel, "configs", None) if kernel is not jit else None
    config = tuple((n, _value_key(v)) for n, v in sorted(configs[0].kwargs.items())) if configs else ()
    return None if any(v is None for _, v in config) else (id(jit), config)


def key(kernel, kwargs: dict, tma) -> tuple | None:
    """The analysis's inputs as a hashable key, or ``None`` where an argument is of an unknown kind."""
    kernel_key = _kernel_key(kernel)
    if kernel_key is None:
        return None
    items = []
    for name in sorted(kwargs):
        k = _value_key(kwargs[name])
        if k is None:
            return None
        items.append((name, k))
    try:
        tma_key = repr(sorted((tma or {}).items()))
    except TypeError:
        return None
    return (kernel_key, tuple(items), tma_key)   # opsmath's kernels are module globals: ids stay


def _cached(fn):
    cache: dict = {}

    @functools.wraps(fn)
    def analysis(kernel, kwargs, tma_descriptor_metadata, *args, **kw):
        k = key(kernel, kwargs, tma_descriptor_metadata) if _ours(kernel) and not args and not kw else None
        if k is None:
            return fn(kernel, kwargs, tma_descriptor_metadata, *args, **kw)
        with _LOCK:
            known = cache.get(k)
            STATS["hits" if known is not None else "misses"] += 1
        if known is None:
            known = cache.setdefault(k, fn(kernel, kwargs, tma_descriptor_metadata))
        try:
            return copy.deepcopy(known)
        except Exception:  # noqa: BLE001  (an answer that cannot be copied: analyzed afresh)
            return fn(kernel, kwargs, tma_descriptor_metadata)
    analysis.cache = cache
    return analysis


def install() -> None:
    """Cache torch's TTIR analysis for opsmath's kernels (once per process; Inductor's ``ir`` module too,
    where it holds the function by name)."""
    global _installed
    if _installed:
        return
    _installed = True
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    import torch._inductor.ir as ir
    for name in NAMES:
        fn = getattr(wrap, name, None)
        if fn is None:
            continue
        cached = _cached(fn)
        setattr(wrap, name, cached)
        if getattr(ir, name, None) is fn:
            setattr(ir, name, cached)
