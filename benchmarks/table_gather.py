"""The gradient of a small table read by many indices: ``opsmath::table_gather``'s backward (per-block one-hot
products, no atomics) against what eager and ``torch.compile`` run for ``F.embedding``'s backward
(``aten.embedding_dense_backward``: atomic adds into the table's rows).

Per shape ``R:N:C`` (a table of R rows and C columns read at N indices, the upstream gradient fp32 as under
AMP, where an embedding's output stays fp32; ``--dtype`` changes it): each variant's call timed with CUDA
events, ``--rounds`` interleaved rounds of ``--iters`` calls, median and spread, the summed kernel time of one
call (``gpu_ms``) and the error against an fp64 ``index_add_``. Indices as T5's relative position buckets
read them (``--order buckets``: neighbouring indices mostly equal), all one row (``one``, as BERT's default
token types) or uniform at random (``random``).

    python -m benchmarks table_gather [--shapes 32:262144:32,2:8192:2048] [--order buckets]

The default shapes: T5 at the fleet's width 2 (32 buckets x 32 heads at 512 x 512 and 128 x 128 pairs),
BERT's token types at widths 1 and 2 (2 rows, B16 T512), and a 1024-row table.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks._harness import kernel_ms, new_shape, rel_err, timed_calls, write
from opsmath.kernels.table_gather import backward_triton

SHAPES = "32:262144:32,32:16384:32,2:8192:2048,2:8192:1024,1024:65536:64"


def _dense_backward(dy, idx, rows):
    return torch.ops.aten.embedding_dense_backward(dy, idx, rows, -1, False)


VARIANTS = {
    "eager": _dense_backward,
    "torch.compile": torch.compile(_dense_backward, dynamic=False),
    "table_gather": backward_triton,
}


def indices(R: int, N: int, order: str, device) -> torch.Tensor:
    """``N`` indices in [0, R): runs of equal values as relative-position buckets are (``buckets``), all 0
    (``one``: BERT's default token types) or uniform at random (``random``)."""
    g = torch.Generator().manual_seed(N + R)
    if order == "one":
        return torch.zeros(N, dtype=torch.long, device=device)
    if order == "random":
        return torch.randint(0, R, (N,), generator=g).to(device)
    side = max(1, int(N ** 0.5))
    q, k = torch.arange(side).view(-1, 1), torch.arange(side).view(1, -1)
    rel = (k - q).flatten()[:N]
    return (rel.abs().clamp(max=R - 1) if R > 2 else (rel > 0).long()).repeat(N // rel.numel() + 1)[:N].to(device)


def measure(shape: str, rounds: int, iters: int, order: str, dtype: torch.dtype) -> dict:
    R, N, C = map(int, shape.split(":"))
    new_shape()
    torch.manual_seed(0)
    dy, idx = torch.randn(N, C, device="cuda", dtype=dtype), indices(R, N, order, "cuda")
    ref = torch.zeros(R, C, dtype=torch.float64, device="cuda").index_add_(0, idx, dy.double())
    outs = {k: f(dy, idx, R) for k, f in VARIANTS.items()}
    times = timed_calls({k: (lambda f=f: f(dy, idx, R)) for k, f in VARIANTS.items()}, rounds, iters)
    med = {k: statistics.median(v) for k, v in times.items()}
    gpu = {k: sum(kernel_ms(lambda f=f: f(dy, idx, R), calls=iters).values()) for k, f in VARIANTS.items()}
    row = dict(shape=shape, R=R, N=N, C=C, order=order, dtype=str(dtype), ms={k: round(v, 4) for k, v in med.items()},
               spread={k: [min(v), max(v)] for k, v in times.items()}, gpu_ms={k: round(v, 4) for k, v in gpu.items()},
               err={k: rel_err(outs[k].double(), ref) for k in VARIANTS},
               gpu_speedup={k: gpu["torch.compile"] / gpu[k] for k in VARIANTS})
    print(f"{shape:18} {order:8} " + "  ".join(
        f"{k} {med[k]:7.3f} ms (gpu {gpu[k]:.3f}, x{row['gpu_speedup'][k]:.2f} vs compile, err {row['err'][k]:.1e})"
        for k in VARIANTS), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--order", default="buckets,one,random", help="of buckets, one, random")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    rows = [measure(s, args.rounds, args.iters, o, getattr(torch, args.dtype))
            for s in args.shapes.split(",") for o in args.order.split(",")]
    print("wrote", write(f"table_gather{args.tag}", dict(rows=rows, args=vars(args))))


if __name__ == "__main__":
    main()
