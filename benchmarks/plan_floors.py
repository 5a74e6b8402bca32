"""The smallest memory budget the recompute plan reaches, as a fraction of the step's activation bytes,
on the bundled examples and on Hugging Face models as they load (tiny widths, CPU, fake-tensor liveness:
no GPU needed). Each model is optimized with ``memory_budget=0.01``, which no plan meets; the error names
the floor. A model whose plan meets 0.25 lists it as feasible. ``--inductor``: the graphs compiled by
Inductor (CPU, needs a C++ compiler), as on CUDA by default: the plan then counts what Inductor's
partitioner saves, and the families Inductor fuses itself are left to it.

    python -m benchmarks plan_floors [--inductor] [name ...]
"""
import re
import sys

import torch

import opsmath
from opsmath import examples
from opsmath.memory.plan import InfeasibleBudget


def _hf(cls, cfg_cls, **cfg):
    import transformers as T
    config = getattr(T, cfg_cls)(attn_implementation="sdpa", **cfg)
    return lambda: getattr(T, cls)(config).train()


TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=172, vocab_size=128)
WIDE = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1376, vocab_size=128)
MODELS = {   # name: model factory (trained on one batch of 2 x 128 tokens)
    "gpt2 12 layers": _hf("GPT2LMHeadModel", "GPT2Config", n_layer=12, n_embd=64, n_head=4, vocab_size=128,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama 8 layers": _hf("LlamaForCausalLM", "LlamaConfig", num_hidden_layers=8, **TINY),
    "mistral 6 layers": _hf("MistralForCausalLM", "MistralConfig", num_hidden_layers=6, **TINY),
    # width 512: the block's share of the activations grows against embeddings, rotary tables and loss
    "llama 8 x 512": _hf("LlamaForCausalLM", "LlamaConfig", num_hidden_layers=8, **WIDE),
    "mistral 6 x 512": _hf("MistralForCausalLM", "MistralConfig", num_hidden_layers=6, **WIDE),
}


def floor(model, call, inductor: bool = False) -> str:
    torch._dynamo.reset()
    opt = opsmath.optimize(model, memory_budget=0.01, inductor=inductor)
    try:
        call(opt)
    except InfeasibleBudget as e:
        m = re.search(r"fraction ([0-9.]+)", str(e))
        return m.group(1) if m else str(e)
    return "0.01 feasible"


def main():
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 128))
    rows = {name: (make, lambda m: m(input_ids=ids, labels=ids).loss.backward()) for name, make in MODELS.items()}
    for name, factory in examples.EXAMPLES.items():
        model, batch = factory()
        rows[f"bundled {name}"] = (lambda model=model: model, lambda m, batch=batch: m(*batch).float().sum().backward())
    inductor = "--inductor" in sys.argv
    names = [a for a in sys.argv[1:] if a != "--inductor"]
    for name, (make, call) in rows.items():
        if names and not any(a in name for a in names):
            continue
        print(f"{name:18} smallest feasible fraction: {floor(make(), call, inductor)}", flush=True)


if __name__ == "__main__":
    main()
