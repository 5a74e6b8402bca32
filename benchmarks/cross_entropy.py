"""Cross-entropy on given logits, fwd+bwd on the GPU: eager ``F.cross_entropy(logits.float(), t)`` (what
autocast training runs on bf16 logits), torch.compile of it, ``opsmath::cross_entropy`` and Liger-Kernel's
``liger_cross_entropy`` when installed, same inputs. Tokens 8192, vocab 32000 / 50304 / 128256, bf16 and
fp32 logits, 10% of targets ignore_index. Effective TB/s = minimal bytes (read the logits, write their
gradient: 2 N V elements) / time; peak above the inputs; numerics against float64 in the same run.
Liger computes the gradient into the logits' own memory (in place), so its numerics run on a copy.

    python -m benchmarks cross_entropy
    python -m benchmarks cross_entropy --smoke     # tiny, on CPU: checks the script, measures nothing
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import opsmath  # noqa: F401
from opsmath.kernels.cross_entropy import cross_entropy
from benchmarks._harness import bench, new_shape, rel_err, write


def eager(z, t):
    return F.cross_entropy(z.float(), t)


def liger_impl():
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except ImportError:
        return {}
    return {"liger": lambda z, t: liger_cross_entropy(z, t)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    impls = {"eager": eager, "torch.compile": torch.compile(eager), "opsmath": lambda z, t: cross_entropy(z, t),
             **({} if args.smoke else liger_impl())}
    shapes = [(64, 1000)] if args.smoke else [(8192, 32000), (8192, 50304), (8192, 128256)]
    rows = []
    for N, V in shapes:
        for dt in (torch.bfloat16, torch.float32):
            new_shape()
            torch.manual_seed(0)
            z = (3 * torch.randn(N, V, device=dev)).to(dt).requires_grad_()
            t = torch.randint(0, V, (N,), device=dev)
            t[::10] = -100
            z64 = z.detach().double().requires_grad_()
            ref = F.cross_entropy(z64, t)
            ref.backward()
            for name, fn in impls.items():
                row = dict(N=N, V=V, dtype=str(dt).replace("torch.", ""), impl=name)
                try:
                    zc = z.detach().clone().requires_grad_()
                    loss = fn(zc, t)
                    loss.backward()
                    row.update(err_loss=rel_err(loss, ref), err_grad=rel_err(zc.grad, z64.grad))
                    zc = None

                    def step():
                        z.grad = None
                        fn(z, t).backward()
                    if dev == "cuda":
                        r = bench(step, device=True)
                        nbytes = 2 * N * V * z.element_size()
                        row.update(ms=r["ms"], peak_gib=r["peak_bytes"] / 2**30, tbps=nbytes / r["ms"] / 1e9,
                                   gpu_ms=r["gpu_ms"], tbps_gpu=nbytes / r["gpu_ms"] / 1e9)
                    else:
                        step()
                except Exception as e:  # recorded, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
                print(f"N{N} V{V} {row['dtype']:9} {name:14} " + (row["error"] if "error" in row else
                      f"{row.get('ms', float('nan')):7.3f} ms {row.get('tbps', float('nan')):6.2f} TB/s "
                      f"gpu {row.get('gpu_ms', float('nan')):7.3f} ms {row.get('tbps_gpu', float('nan')):6.2f} TB/s "
                      f"peak {row.get('peak_gib', float('nan')):6.2f} GiB  err loss {row['err_loss']:.1e} "
                      f"grad {row['err_grad']:.1e}"), flush=True)
            z = z64 = ref = None
            if dev == "cuda":
                torch.cuda.empty_cache()
    if not args.smoke:
        print("wrote", write("cross_entropy", dict(rows=rows)))


if __name__ == "__main__":
    main()
