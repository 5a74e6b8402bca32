"""HF Accelerate's ``prepare`` with opsmath, gradient accumulation included: ``optimize`` the model first.

    python examples/accelerate_loop.py       # a tiny LLaMA on CPU; on a GPU: mixed_precision="bf16"

``optimize`` goes on the model before ``accelerator.prepare``: prepare moves and wraps it (DDP, FSDP) and
the wrapper calls it as a plain module, so the captured graphs are opsmath's. Leave Accelerate's dynamo
plugin off, or name opsmath as its backend (``backend="opsmath"``: see the README). ``accumulate`` and
``backward`` work as written: each micro-batch is one captured call; the optimizer steps once per window.
"""
from __future__ import annotations

import torch
import transformers
from accelerate import Accelerator

import opsmath


def main(steps: int = 3, accumulate: int = 2) -> opsmath.Report:
    torch.manual_seed(0)
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256)
    model = opsmath.optimize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims)))
    accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no",
                              gradient_accumulation_steps=accumulate, cpu=not torch.cuda.is_available())
    data = torch.utils.data.TensorDataset(torch.randint(0, 256, (4 * steps * accumulate, 32)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=4))
    for (ids,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    report = opsmath.report(accelerator.unwrap_model(model))
    print(report)
    return report


if __name__ == "__main__":
    main()
