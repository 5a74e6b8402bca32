"""Ahead-of-time compilation of opsmath's Triton kernels for a GPU target, on a machine without a GPU.

``record_launches(records)`` patches Triton's interpreter so that every kernel launch made while it is
active is appended to ``records`` as Triton's JIT would specialize it on a GPU: integer arguments equal
to 1 become the constant 1, and integers and pointers divisible by 16 carry the ``tt.divisibility`` hint
(what lets the compiler vectorize a load and pipeline it with ``cp.async``). ``compile_record`` then
compiles one record for a ``GPUTarget`` with ``triton.compile``: the frontend, TTGIR, LLVM and ptxas, as
the GPU's JIT would. Records are plain JSON (they cross a process boundary: the interpreter must be off
to compile).

Used by ``tests/test_kernels_compile_for_hopper.py`` (every kernel compiles for sm_90) and by
``benchmarks/sass_stats.py`` (instructions, registers and occupancy of a kernel, read off its SASS).
"""
from __future__ import annotations

import contextlib
import inspect

import torch

_TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
       torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def _encode(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if type(v).__name__ == "dtype" and hasattr(v, "primitive_bitwidth"):   # a triton.language dtype
        return {"tl_dtype": v.name}
    raise TypeError(f"constexpr of type {type(v).__name__}")


def _specialize(fn, arg_names, args, kwargs) -> dict:
    """One launch as a record: kernel, signature, constexprs, divisible argument indices, options."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    sig, consts, div16 = {}, {}, []
    for i, (name, p) in enumerate(params.items()):
        v = bound.get(name, p.default)
        if str(p.annotation).endswith("constexpr") or v is None:
            sig[name], consts[name] = "constexpr", _encode(v)
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TY[v.dtype]
            if v.data_ptr() % 16 == 0:
                div16.append(i)
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1:      # the JIT makes an integer 1 a constant
                sig[name], consts[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:
                    div16.append(i)
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
    options = {k: v for k, v in kwargs.items() if k not in params}
    return dict(module=fn.__module__, kernel=fn.__name__, signature=sig, constexprs=consts, div16=div16,
                options=options)


@contextlib.contextmanager
def record_launches(records: list):
    """While active (with ``TRITON_INTERPRET=1``), append each interpreted kernel launch to ``records``."""
    from triton.runtime.interpreter import InterpretedFunction
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        records.append(_specialize(self.fn, self.arg_names, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    InterpretedFunction.run = recording_run
    try:
        yield records
    finally:
        InterpretedFunction.run = run


def compile_record(record: dict, target=None):
    """``triton.compile`` of one record for ``target`` (default: sm_90, the H200); needs the interpreter
    off. Returns the compiled kernel (``.asm["cubin"]``, ``.asm["ptx"]``)."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(record["module"]), record["kernel"])
    consts = {k: tl.dtype(v["tl_dtype"]) if isinstance(v, dict) else v for k, v in record["constexprs"].items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i in record.get("div16", [])}
    src = ASTSource(fn=fn, signature=record["signature"], constexprs=consts, attrs=attrs)
    return triton.compile(src, target=target or GPUTarget("cuda", 90, 32), options=record["options"])


def shared_bytes(record: dict, target=None) -> int:
    """Bytes of shared memory one record's kernel uses per block, compiled for ``target`` (default sm_90)."""
    return compile_record(record, target).metadata.shared
