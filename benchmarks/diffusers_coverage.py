"""Held-out diffusion models from ``diffusers`` (tiny configs, CPU, fp32, training mode): what opsmath
rewrites, and the output and worst parameter-gradient error against eager, measured as in
``hf_coverage.py`` (relative, with an atol of 1e-3 of the largest gradient norm, for gradients that are
zero in exact arithmetic such as a key projection's bias under softmax). Needs ``pip install diffusers``.

    python benchmarks/diffusers_coverage.py
"""
import copy
from collections import Counter

import torch

import opsmath
from hf_coverage import worst_grad_error


def unet():
    from diffusers import UNet2DConditionModel
    m = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                             block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                             up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                             attention_head_dim=8, norm_num_groups=8)
    return m, dict(sample=torch.randn(2, 4, 16, 16), timestep=torch.tensor([10, 500]),
                   encoder_hidden_states=torch.randn(2, 7, 32))


def dit():
    from diffusers import DiTTransformer2DModel
    m = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=2,
                              sample_size=8, patch_size=2, norm_num_groups=8)
    return m, dict(hidden_states=torch.randn(2, 4, 8, 8), timestep=torch.tensor([10, 500]),
                   class_labels=torch.tensor([1, 3]))


def check(factory) -> str:
    torch.manual_seed(0)
    model, kw = factory()
    model.train()
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    opt = opsmath.optimize(model)
    y, y_e = opt(**kw).sample, eager(**kw).sample
    w = torch.randn_like(y)
    (y * w).sum().backward()
    (y_e * w).sum().backward()
    rep = opsmath.report(opt)
    return (f"out {((y - y_e).norm() / y_e.norm()).item():.1e}  dgrad {worst_grad_error(opt, eager):.1e}  "
            f"rewrites {dict(Counter(m.pattern for m in rep.matches))}  declines {len(rep.declines)}  "
            f"fallbacks {len(rep.fallback_errors)}  kept eager {len(rep.eager_regions)}")


if __name__ == "__main__":
    for name, factory in (("unet2d-condition", unet), ("dit", dit)):
        print(f"{name:18} {check(factory)}", flush=True)
