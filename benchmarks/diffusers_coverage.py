"""Held-out diffusion models from ``diffusers`` (tiny configs, CPU, fp32, training mode): what opsmath
rewrites, and the output and worst parameter-gradient error against eager, measured as in
``hf_coverage.py`` (relative, with an atol of 1e-3 of the largest gradient norm, for gradients that are
zero in exact arithmetic such as a key projection's bias under softmax). Needs ``pip install diffusers``.

    python -m benchmarks diffusers_coverage
"""
import copy
from collections import Counter

import torch

import opsmath
from benchmarks.hf_coverage import worst_grad_error


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


def sd3():
    from diffusers import SD3Transformer2DModel
    m = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                              num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                              pooled_projection_dim=16, out_channels=4)
    return m, dict(hidden_states=torch.randn(2, 4, 8, 8), encoder_hidden_states=torch.randn(2, 5, 32),
                   pooled_projections=torch.randn(2, 16), timestep=torch.tensor([10, 500]))


def flux():
    from diffusers import FluxTransformer2DModel
    m = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                               axes_dims_rope=(4, 6, 6))
    return m, dict(hidden_states=torch.randn(2, 16, 16), encoder_hidden_states=torch.randn(2, 5, 32),
                   pooled_projections=torch.randn(2, 16), timestep=torch.tensor([0.1, 0.5]), img_ids=torch.zeros(16, 3),
                   txt_ids=torch.zeros(5, 3))


def pixart():
    from diffusers import PixArtTransformer2DModel
    m = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                 num_layers=2, cross_attention_dim=32, caption_channels=24, sample_size=8, patch_size=2,
                                 norm_num_groups=8)
    return m, dict(hidden_states=torch.randn(2, 4, 8, 8), encoder_hidden_states=torch.randn(2, 5, 24),
                   timestep=torch.tensor([10, 500]), added_cond_kwargs={"resolution": None, "aspect_ratio": None})


def vae():
    from diffusers import AutoencoderKL
    m = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(16, 32), latent_channels=4, norm_num_groups=8,
                      down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                      layers_per_block=1)
    return m, dict(sample=torch.randn(2, 3, 16, 16))


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
    for name, factory in (("unet2d-condition", unet), ("dit", dit), ("sd3-mmdit", sd3), ("flux", flux),
                          ("pixart-alpha", pixart), ("vae-kl", vae)):
        print(f"{name:18} {check(factory)}", flush=True)
