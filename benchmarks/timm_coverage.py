"""Held-out vision models from ``timm`` (random init, CPU, fp32, training mode, stochastic depth 0.1):
what opsmath rewrites, and the loss, output and worst parameter-gradient and buffer errors against eager,
measured as in ``hf_coverage.py`` (gradients relative, with an atol of 1e-3 of the largest gradient norm;
buffers such as BatchNorm running statistics likewise: a running mean of normalized inputs is ~1e-9, where
a plain relative error would be noise). Needs ``pip install timm``.

    python -m benchmarks timm_coverage [model ...] [--size 224] [--amp]

``--amp``: both sides under CPU bf16 autocast (fp32 weights), and beside each row opsmath's and eager's
gradient errors against fp32 eager (the tolerance rule's form).
"""
import argparse
import copy
from collections import Counter

import torch
import torch.nn.functional as F

import opsmath
from benchmarks.hf_coverage import worst_grad_error

MODELS = ["vit_small_patch16_224", "deit_tiny_patch16_224", "beit_base_patch16_224", "eva02_tiny_patch14_224",
          "swin_tiny_patch4_window7_224", "swinv2_cr_tiny_224", "maxvit_tiny_tf_224", "coatnet_0_rw_224",
          "cait_xxs24_224", "xcit_nano_12_p16_224", "pvt_v2_b0", "twins_svt_small", "levit_128s",
          "convnext_atto", "resnet18", "efficientnet_b0", "poolformer_s12"]


def worst_buffer_error(opt, eager) -> float:
    """``max ||b - b_eager|| / (||b_eager|| + 1e-3 max ||b_eager||)`` over the floating-point buffers."""
    pairs = [(a.float(), b.float()) for a, b in zip(opt.buffers(), eager.buffers()) if b.is_floating_point()]
    if not pairs:
        return 0.0
    atol = max(1e-3 * max(b.norm().item() for _, b in pairs), 1e-12)   # all-zero buffers: an absolute error
    return max((a - b).norm().item() / (b.norm().item() + atol) for a, b in pairs)


def check(name: str, size: int, amp: bool = False) -> str:
    import timm
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, drop_path_rate=0.1).train()
    eager, reference = copy.deepcopy(model), copy.deepcopy(model)
    torch._dynamo.reset()
    opt = opsmath.optimize(model)
    x, y = torch.randn(2, 3, size, size), torch.tensor([1, 3])
    losses = []
    for m, cast in ((opt, amp), (eager, amp)) + (((reference, False),) if amp else ()):
        torch.manual_seed(1)   # the same stochastic-depth draws on both sides
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
            loss = F.cross_entropy(m(x).float(), y)
        loss.backward()
        losses.append(loss.item())
    rep = opsmath.report(opt)
    own = (f"  (vs fp32: dgrad opsmath {worst_grad_error(opt, reference):.1e}, eager "
           f"{worst_grad_error(eager, reference):.1e})") if amp else ""
    return (f"loss {losses[0]:.6f} / {losses[1]:.6f}  dgrad {worst_grad_error(opt, eager):.1e}{own}  "
            f"dbuf {worst_buffer_error(opt, eager):.1e}  rewrites {dict(Counter(m.pattern for m in rep.matches))}  "
            f"declines {len(rep.declines)}  fallbacks {len(rep.fallback_errors)}  kept eager {len(rep.eager_regions)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=MODELS)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--amp", action="store_true", help="both sides under CPU bf16 autocast")
    args = ap.parse_args()
    for name in args.models:
        try:
            print(f"{name:30} {check(name, args.size, args.amp)}", flush=True)
        except Exception as e:  # noqa: BLE001  (reported; the other models still run)
            print(f"{name:30} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
