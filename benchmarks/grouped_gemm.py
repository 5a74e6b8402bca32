"""FP8 against bf16 grouped GEMMs of mixture-of-experts layers, forward and backward, where
``fp8_experts`` pays (its ``MIN_DIM`` and ``MIN_ROWS``).

Per shape ``S:G:K:N`` (S rows sorted over G experts, K -> N; weights stored [G, N, K] as ``nn.Linear``
stacks are, read transposed): ``y = grouped(x, w^T)`` and its backward against a fixed upstream gradient,
each variant compiled by ``torch.compile`` (Inductor fuses the FP8 casts and amax reductions into their
producers), ``--rounds`` interleaved rounds of ``--iters`` calls timed with CUDA events: median and
spread per variant, the summed kernel time of one call (torch.profiler, ``gpu_ms``; in a training step
the kernels are what costs, the host runs ahead), FP8's speed-up by both, and FP8's forward error
against the bf16 product. Groups are equal
in size, or (``--imbalanced``) half of all rows go to expert 0.

    python -m benchmarks grouped_gemm [--shapes 16384:8:1024:5632,...] [--rounds 5] [--iters 20]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks._harness import kernel_ms, new_shape, rel_err, write
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


def measure(shape: str, rounds: int, iters: int, imbalanced: bool) -> dict:
    S, G, K, N = map(int, shape.split(":"))
    new_shape()
    torch.manual_seed(0)
    x = torch.randn(S, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(G, N, K, device="cuda") / K ** 0.5).to(torch.bfloat16).requires_grad_()
    dy, offs = torch.randn(S, N, device="cuda", dtype=torch.bfloat16), offsets(S, G, imbalanced, "cuda")
    fns = {"bf16": torch.compile(lambda a, b, o: torch._grouped_mm(a, b, offs=o)),
           "fp8": torch.compile(fp8_grouped_mm)}
    outs = {k: step(f, x, w, offs, dy).float() for k, f in fns.items()}
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                step(f, x, w, offs, dy)
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) / iters)
        x.grad = w.grad = None
    med = {k: statistics.median(v) for k, v in times.items()}
    gpu = {k: sum(kernel_ms(lambda: step(f, x, w, offs, dy), calls=iters).values()) for k, f in fns.items()}
    row = dict(shape=shape, S=S, G=G, K=K, N=N, imbalanced=imbalanced,
               ms={k: round(v, 4) for k, v in med.items()}, spread={k: [min(v), max(v)] for k, v in times.items()},
               gpu_ms={k: round(v, 4) for k, v in gpu.items()}, fp8_speedup=med["bf16"] / med["fp8"],
               fp8_gpu_speedup=gpu["bf16"] / gpu["fp8"], fp8_fwd_rel_err=rel_err(outs["fp8"], outs["bf16"]))
    print(f"{shape:24} {'imbalanced' if imbalanced else 'balanced':10} bf16 {med['bf16']:7.3f} ms (gpu "
          f"{gpu['bf16']:.3f})  fp8 {med['fp8']:7.3f} ms (gpu {gpu['fp8']:.3f})  x{row['fp8_speedup']:.3f} (gpu "
          f"x{row['fp8_gpu_speedup']:.3f})  fwd err {row['fp8_fwd_rel_err']:.4f}", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--imbalanced", action="store_true", help="also each shape with half the rows on expert 0")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        for imb in (False, True) if args.imbalanced else (False,):
            try:
                rows.append(measure(shape, args.rounds, args.iters, imb))
            except Exception as e:  # noqa: BLE001  (a shape the kernels refuse is a row, not the end)
                rows.append(dict(shape=shape, imbalanced=imb, error=f"{type(e).__name__}: {e}"[:1000]))
                print(shape, rows[-1]["error"], flush=True)
            torch.cuda.empty_cache()
    print("wrote", write("grouped-gemm-fp8" + args.tag, dict(args=vars(args), rows=rows)), flush=True)


if __name__ == "__main__":
    main()
