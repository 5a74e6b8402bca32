"""dropout + residual add + LayerNorm/RMSNorm fwd+bwd on the GPU: opsmath vs eager (and torch.compile with
``--compile``), same inputs. Effective TB/s = minimal bytes / time, minimal bytes = 8 row-tensors
(fwd reads x, residual and writes out, h; bwd reads dout, h and writes dx, dresidual).

    python -m benchmarks dropout_add_norm [--quick] [--compile]
"""
from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

import opsmath  # noqa: F401
from opsmath.kernels.dropout_add_norm import dropout_add_norm_op
from benchmarks._harness import bench, new_shape, rel_err, write


def eager(x, r, w, b, rms, p):
    h = r + F.dropout(x, p)
    if rms:
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype) * w
    return F.layer_norm(h, (h.shape[-1],), w, b, 1e-6)


@functools.lru_cache(maxsize=None)
def _seed(device):
    """One device seed drawn up front: in a rewritten graph all fused ops' seeds come from one draw per
    step (``match.batch_seeds``), so the op's own time excludes it."""
    return torch.randint(0, 2**31 - 1, (), device=device)


def ours(x, r, w, b, rms, p):
    return dropout_add_norm_op(x, r, w, None if rms else b, rms, 1e-6, p, _seed(x.device), x.dtype)[0]


def liger():
    """Liger-Kernel's versions where it has them (``pip install liger_kernel-*.whl --no-deps`` on the GPU
    machine; its wheel is pure Python): LayerNorm after an eager dropout + add, and its fused add +
    RMSNorm (no dropout: it has none, so that row runs at p = 0 whatever the case says)."""
    try:
        from liger_kernel.transformers.functional import liger_fused_add_rms_norm, liger_layer_norm
    except ImportError:
        return {}

    def run(x, r, w, b, rms, p):
        if rms:
            return liger_fused_add_rms_norm(x, r, w, 1e-6, in_place=False)[0]
        return liger_layer_norm(r + F.dropout(x, p), w, b, 1e-6)
    return {"liger": run}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    impls = {"eager": eager, "opsmath_kernel": ours, **liger()}
    if args.compile:
        impls["compile_eager"] = torch.compile(eager)
    rows = []
    M = 16384
    widths = (1024, 4096) if args.quick else (768, 1024, 4096, 8192)
    for dt in (torch.bfloat16, torch.float32):
        for N in widths:
            for rms in (False, True):
                new_shape()
                x = torch.randn(M, N, device="cuda", dtype=dt, requires_grad=True)
                r = torch.randn(M, N, device="cuda", dtype=dt, requires_grad=True)
                w = torch.randn(N, device="cuda", dtype=dt, requires_grad=True)
                b = torch.randn(N, device="cuda", dtype=dt, requires_grad=True)
                dy = torch.randn(M, N, device="cuda", dtype=dt)
                nbytes = 8 * M * N * x.element_size()
                ref = eager(*(t.detach().double().requires_grad_() for t in (x, r, w, b)), rms, 0.0)
                ref.backward(dy.double())
                for name, fn in impls.items():
                    row = dict(dtype=str(dt).replace("torch.", ""), M=M, N=N, norm="rms" if rms else "layer",
                               impl=name, dropout=0.1)
                    out = fn(x, r, w, b, rms, 0.0)  # numerics with dropout off
                    row["err_out"] = rel_err(out, ref)

                    def step():
                        x.grad = r.grad = w.grad = b.grad = None
                        fn(x, r, w, b, rms, 0.1).backward(dy)
                    t = bench(step, device=True)
                    row.update(ms=t["ms"], tbps=nbytes / t["ms"] / 1e9, peak_gib=t["peak_bytes"] / 2**30,
                               gpu_ms=t["gpu_ms"], tbps_gpu=nbytes / t["gpu_ms"] / 1e9)
                    rows.append(row)
                x = r = w = b = dy = ref = None  # free before the next shape
                torch.cuda.empty_cache()
    path = write("dropout_add_norm", dict(rows=rows))
    print(f"{'dtype':9} {'N':>5} {'norm':5} {'impl':15} {'TB/s':>6} {'ms':>7} {'gpuTB/s':>7} {'gpu ms':>7} "
          f"{'GiB':>6} {'err':>9}")
    for r in rows:
        print(f"{r['dtype']:9} {r['N']:5} {r['norm']:5} {r['impl']:15} {r['tbps']:6.2f} {r['ms']:7.3f} "
              f"{r['tbps_gpu']:7.2f} {r['gpu_ms']:7.3f} {r['peak_gib']:6.2f} {r['err_out']:9.2e}")
    print("wrote", path)


if __name__ == "__main__":
    main()
