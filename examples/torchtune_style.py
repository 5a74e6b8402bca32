"""A torchtune-style recipe: each decoder layer compiled on its own with ``backend="opsmath"``, and the
optimizer step inside backward.

    python examples/torchtune_style.py       # a tiny LLaMA on CPU; on a GPU the same under bf16 autocast

torchtune compiles a model layer by layer (``layer.compile(...)``): one graph per layer, captured once and
reused by every layer of the same shape. Naming opsmath as the backend rewrites each layer's graph
(``opsmath.report(layer)`` reads it). Its ``optimizer_in_bwd`` is ``opsmath.optim.AdamW(...,
in_backward=True)`` here: each parameter is updated as soon as its gradient is final and the gradient
freed; with one compiled backward per layer, a layer's gradients are freed before the next layer's exist.
"""
from __future__ import annotations

import torch
import transformers

import opsmath


def main(steps: int = 3, optimized: bool = True):
    """Train ``steps`` steps; returns the model, its per-step losses, and the first layer's report (None
    with ``optimized=False``: eager, torch's AdamW stepping after backward, to compare)."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims)).to(device)
    if optimized:
        for layer in model.model.layers:
            layer.compile(backend="opsmath")
        opt = opsmath.optim.AdamW(model.parameters(), lr=1e-3, in_backward=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(step)).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()           # in backward: already done, nothing left to step
        opt.zero_grad()
        losses.append(loss.item())
    report = opsmath.report(model.model.layers[0]) if optimized else None
    print(report if optimized else "eager", "\nlosses", [round(x, 4) for x in losses])
    return model, losses, report


if __name__ == "__main__":
    main()
