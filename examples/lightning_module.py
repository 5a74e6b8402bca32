"""A Lightning ``LightningModule`` with opsmath: ``optimize`` the network inside the module's ``__init__``.

    python examples/lightning_module.py      # a tiny LLaMA, 3 steps on CPU; on a GPU: precision="bf16-mixed"

The module holds the optimized network as an attribute: Lightning moves it to the device, wraps it for
DDP/FSDP and runs ``training_step``, which calls it as a plain module, so the captured graphs are opsmath's.
Leave Lightning's own compilation off (opsmath compiles already). ``precision="bf16-mixed"`` is fp32
weights under bf16 autocast, which opsmath rewrites as autocast computes (docs/design.md, Mixed precision).
"""
from __future__ import annotations

import lightning as L
import torch
import transformers

import opsmath


class CausalLM(L.LightningModule):
    def __init__(self, dims: dict):
        super().__init__()
        self.net = opsmath.optimize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims)))

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        return self.net(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def main(steps: int = 3) -> opsmath.Report:
    torch.manual_seed(0)
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256)
    module = CausalLM(dims)
    data = torch.utils.data.TensorDataset(torch.randint(0, 256, (16, 32)))
    cuda = torch.cuda.is_available()
    trainer = L.Trainer(max_steps=steps, accelerator="gpu" if cuda else "cpu", devices=1,
                        precision="bf16-mixed" if cuda else "32-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    report = opsmath.report(module.net)
    print(report)
    return report


if __name__ == "__main__":
    main()
