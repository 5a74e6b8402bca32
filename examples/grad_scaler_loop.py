"""A plain training loop with fp16 autocast and ``torch.amp.GradScaler``, opsmath's fused AdamW stepping.

    python examples/grad_scaler_loop.py      # a tiny LLaMA on CPU (fp16 autocast on CPU); the same on a GPU

fp16 needs loss scaling: ``scaler.scale(loss).backward()`` then ``scaler.step(opt)``. ``opsmath.optim.AdamW``
declares ``_step_supports_amp_scaling``, so the scaler hands it the scale and its inf check: the gradients
are unscaled inside the fused step, and a step with inf/NaN gradients changes nothing, as the scaler would
skip it. ``torch.optim.AdamW`` works the same way here (the scaler unscales first). Clip with
``max_grad_norm=`` on the optimizer (computed on the unscaled gradients), not with ``clip_grad_norm_``
between ``backward`` and ``step``, which would see scaled gradients unless ``scaler.unscale_`` ran first.
"""
from __future__ import annotations

import torch
import transformers

import opsmath


def main(steps: int = 4, optimized: bool = True) -> tuple[opsmath.Report | None, list[float]]:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims)).to(device)
    model = opsmath.optimize(model) if optimized else model   # eager with optimized=False, to compare
    opt = opsmath.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    scaler = torch.amp.GradScaler(device)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (4, 32), device=device)
        with torch.autocast(device, dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    report = opsmath.report(model) if optimized else None
    print(report if optimized else "eager")
    print("losses", [round(x, 4) for x in losses], "scale", scaler.get_scale())
    return report, losses


if __name__ == "__main__":
    main()
