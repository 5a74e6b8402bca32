"""HF ``Trainer`` with opsmath: ``optimize`` the model before handing it to the Trainer.

    python examples/hf_trainer.py            # a tiny LLaMA, 3 steps, bf16=True (fp32 weights; CPU or GPU)
    python examples/hf_trainer.py 3 --gradient-checkpointing   # the same, each layer recomputed in backward

``optimize`` goes on the model, before ``Trainer(...)``: the Trainer moves it, wraps it (DDP, or FSDP through
Accelerate) and calls it as a plain module, so the captured graphs are opsmath's. Leave ``torch_compile``
off in ``TrainingArguments``: opsmath compiles already (with ``torch_compile=True`` the Trainer would wrap
the optimized module in ``torch.compile``, which skips opsmath's frame). ``bf16=True`` is the usual recipe:
fp32 weights under bf16 autocast, which opsmath rewrites as autocast computes (docs/design.md). Accelerate
enters that autocast inside ``model.forward``; opsmath captures the region and runs the graph under it.
``gradient_checkpointing=True`` works as written: each checkpointed layer is rewritten inside and still recomputed
in backward (docs/training.md).
"""
from __future__ import annotations

import sys
import tempfile

import torch
import transformers

import opsmath


def main(steps: int = 3, size: str = "tiny", gradient_checkpointing: bool = False) -> opsmath.Report:
    torch.manual_seed(0)
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256) if size == "tiny" else {}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims))
    model = opsmath.optimize(model)
    ids = torch.randint(0, model.config.vocab_size, (16, 32))
    data = [dict(input_ids=row, labels=row) for row in ids]
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-4, bf16=True,
            use_cpu=not cuda, report_to=[], logging_steps=1, save_strategy="no", dataloader_num_workers=0,
            gradient_checkpointing=gradient_checkpointing)
        transformers.Trainer(model=model, args=args, train_dataset=data).train()
    report = opsmath.report(model)
    print(report)
    return report


if __name__ == "__main__":
    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    main(steps=int(numbers[0]) if numbers else 3, gradient_checkpointing="--gradient-checkpointing" in sys.argv)
