"""Grouped GEMMs of mixture-of-experts layers, forward and backward, against bf16 ``torch._grouped_mm``:
FP8 (where ``fp8_experts`` pays: its ``fp8_pays``), opsmath's own Triton kernels (no host sync, as on
GPUs where PyTorch's grouped GEMM is a per-group loop), and the fp32 paths of HF's fallback under AMP.

Per shape ``S:G:K:N`` (S rows sorted over G experts, K -> N; weights stored [G, N, K] as ``nn.Linear``
stacks are, read transposed): ``y = grouped(x, w^T)`` and its backward against a fixed upstream gradient,
each variant (``--variants``, ``VARIANTS``) compiled by ``torch.compile`` for this shape alone (Inductor
fuses the FP8 casts and amax reductions into their producers), ``--rounds`` interleaved rounds of
``--iters`` calls timed with CUDA events: median and spread per variant, the summed kernel time of one
call (torch.profiler, ``gpu_ms``; in a training step the kernels are what costs, the host runs ahead),
each variant's speed-up against bf16 by both, and its forward error against the bf16 product. Groups are
equal in size, or (``--imbalanced``) half of all rows go to expert 0.

    python -m benchmarks grouped_gemm [--shapes 16384:8:1024:5632,...] [--variants bf16,fp8,own bf16]
    python -m benchmarks grouped_gemm --variants "index+bf16 (top-2),gather (top-2)"   # the gathered first GEMM
"""
from __future__ import annotations

import argparse
import os
import statistics
from unittest import mock

import torch

from benchmarks._harness import kernel_ms, new_shape, rel_err, timed_calls, write
import opsmath.kernels.grouped_mm as gm
from opsmath.kernels.fp8_grouped_mm import fp8_grouped_mm

SHAPES = ("16384:8:1024:5632,16384:8:2816:1024,65536:64:1024:1408,65536:64:704:1024,16384:8:512:1024,"
          "16384:8:1024:1024,4096:8:1024:2816,16384:8:2048:2048,16384:8:4096:14336,16384:8:14336:4096")


def offsets(S: int, G: int, imbalanced: bool, device) -> torch.Tensor:
    sizes = [S // G] * G if not imbalanced else [S // 2] + [S // 2 // (G - 1)] * (G - 1)
    sizes[-1] += S - sum(sizes)
    return torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)


def step(fn, x, w, offs, dy):
    y = fn(x, w.transpose(1, 2), offs)
    y.backward(dy)
    return y


class Own:
    """``opsmath::grouped_mm`` (opaque to Inductor) with its Triton kernels taking ``dtype_list`` and fp32 on
    CUDA as ``fp32`` says (``OPSMATH_FP32_GROUPED_GEMM``: "tf32x3" or "split" on the Triton kernels, "mm" per group),
    the setting held around forward and backward (``step``)."""

    def __init__(self, dtype_list, fp32="tf32x3"):
        self.fn = torch.compile(lambda a, b, o: torch.ops.opsmath.grouped_mm(a, b, o))
        self.dtype_list, self.fp32 = dtype_list, fp32

    def step(self, *args):
        with mock.patch.object(gm, "TRITON_DTYPES", self.dtype_list), \
                mock.patch.dict(os.environ, {"OPSMATH_FP32_GROUPED_GEMM": self.fp32}):
            return step(self.fn, *args)


# name: (the grouped GEMM, its operands' dtype); "bf16" is the baseline every speed-up is against
VARIANTS = {
    "bf16": (lambda a, b, o: torch._grouped_mm(a, b, offs=o), torch.bfloat16),
    "fp8": (fp8_grouped_mm, torch.bfloat16),
    "own bf16": (Own((torch.bfloat16,)), torch.bfloat16),                     # Triton, no host sync
    "fp32 per-group mm": (Own((), "mm"), torch.float32),                      # HF's fp32 fallback's way
    "fp32 own Triton": (Own(()), torch.float32),                              # three TF32 products a tile
    "fp32 split ahead": (Own((), "split"), torch.float32),                    # ... the token operand split ahead
    # the first GEMM of an MoE layer under top-2 routing: S rows gathered from S / 2 tokens (``_ROWS``), by
    # an index then torch's grouped GEMM, or read through the index by opsmath::grouped_mm_gather
    "index+bf16 (top-2)": (lambda a, b, o: torch._grouped_mm(a[: a.shape[0] // 2][_ROWS[a.shape[0]]], b, offs=o),
                           torch.bfloat16),
    "gather (top-2)": (lambda a, b, o: torch.ops.opsmath.grouped_mm_gather(a[: a.shape[0] // 2], _ROWS[a.shape[0]],
                                                                           b, o), torch.bfloat16),
}
GATHERED = ("index+bf16 (top-2)", "gather (top-2)")   # their errors are against each other, not bf16's
FP32 = ("fp32 per-group mm", "fp32 own Triton", "fp32 split ahead")   # ... and these (cuBLAS fp32 the reference)
_ROWS: dict = {}


def token_rows(S: int, offs: torch.Tensor) -> torch.Tensor:
    """The token (of ``S // 2``) each of ``S`` rows sorted by expert reads: random, ascending within each
    expert's rows, as a stable sort by expert leaves them."""
    g = torch.Generator().manual_seed(S)
    rows = torch.randint(0, S // 2, (S,), generator=g)
    ends = [0] + offs.tolist()
    return torch.cat([rows[s:e].sort().values for s, e in zip(ends, ends[1:])]).to(offs.device)


def _stepper(fn):
    """fwd + bwd of ``fn``: compiled for this shape, or an ``Own`` path's step (compiled already)."""
    if isinstance(fn, Own):
        return fn.step
    compiled = torch.compile(fn)
    return lambda *args: step(compiled, *args)


def _against(name: str, outs: dict) -> str:
    """The variant whose output ``name``'s error is taken against: the first of its own kind, else bf16."""
    for kind in (GATHERED, FP32):
        if name in kind and kind[0] in outs:
            return kind[0]
    return "bf16"


def measure(shape: str, rounds: int, iters: int, imbalanced: bool, names=("bf16", "fp8")) -> dict:
    S, G, K, N = map(int, shape.split(":"))
    new_shape()
    torch.manual_seed(0)
    x = torch.randn(S, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(G, N, K, device="cuda") / K ** 0.5).to(torch.bfloat16).requires_grad_()
    dy, offs = torch.randn(S, N, device="cuda", dtype=torch.bfloat16), offsets(S, G, imbalanced, "cuda")
    _ROWS[S] = token_rows(S, offs)
    args = {dt: (x.detach().to(dt).requires_grad_(), w.detach().to(dt).requires_grad_(), offs, dy.to(dt))
            for dt in {VARIANTS[k][1] for k in ("bf16", *names)}}
    fns = {k: (_stepper(VARIANTS[k][0]), args[VARIANTS[k][1]]) for k in ("bf16", *names)}
    outs = {k: f(*a).float() for k, (f, a) in fns.items()}
    def drop_grads():
        for a in args.values():
            a[0].grad = a[1].grad = None
    times = timed_calls({k: (lambda f=f, a=a: f(*a)) for k, (f, a) in fns.items()}, rounds, iters, drop_grads)
    med = {k: statistics.median(v) for k, v in times.items()}
    gpu = {k: sum(kernel_ms(lambda: f(*a), calls=iters).values()) for k, (f, a) in fns.items()}
    row = dict(shape=shape, S=S, G=G, K=K, N=N, imbalanced=imbalanced,
               ms={k: round(v, 4) for k, v in med.items()}, spread={k: [min(v), max(v)] for k, v in times.items()},
               gpu_ms={k: round(v, 4) for k, v in gpu.items()},
               speedup={k: med["bf16"] / med[k] for k in fns}, gpu_speedup={k: gpu["bf16"] / gpu[k] for k in fns},
               fwd_rel_err={k: rel_err(outs[k], outs[_against(k, outs)]) for k in fns})
    if "fp8" in fns:
        row.update(fp8_speedup=row["speedup"]["fp8"], fp8_gpu_speedup=row["gpu_speedup"]["fp8"],
                   fp8_fwd_rel_err=row["fwd_rel_err"]["fp8"])
    print(f"{shape:24} {'imbalanced' if imbalanced else 'balanced':10} " + "  ".join(
        f"{k} {med[k]:7.3f} ms (gpu {gpu[k]:.3f}, x{row['speedup'][k]:.3f}, gpu x{row['gpu_speedup'][k]:.3f}, "
        f"err {row['fwd_rel_err'][k]:.4f})" for k in fns), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--imbalanced", action="store_true", help="also each shape with half the rows on expert 0")
    ap.add_argument("--variants", default="bf16,fp8", help="of " + ", ".join(VARIANTS) + " (speed-ups against bf16)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        for imb in (False, True) if args.imbalanced else (False,):
            try:
                rows.append(measure(shape, args.rounds, args.iters, imb, tuple(args.variants.split(","))))
            except Exception as e:  # noqa: BLE001  (a shape the kernels refuse is a row, not the end)
                rows.append(dict(shape=shape, imbalanced=imb, error=f"{type(e).__name__}: {e}"[:1000]))
                print(shape, rows[-1]["error"], flush=True)
            torch.cuda.empty_cache()
    print("wrote", write("grouped-gemm-fp8" + args.tag, dict(args=vars(args), rows=rows)), flush=True)


if __name__ == "__main__":
    main()
