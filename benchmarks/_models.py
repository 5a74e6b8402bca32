"""Model variants the step benchmarks share: GPT-2-small as research code writes it (hand-written
attention, ``opsmath.examples.GPT``), the same with SDPA, the same with per-block checkpointing, and the
Hugging Face LLaMA of the end-to-end issue built from a config (no download)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opsmath.examples import GPT, Block

GPT2_SMALL = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.1)


def gpt2_batch(device="cuda", B=8, T=1024):
    """One batch of random tokens for GPT-2-small and its next-token targets (seeded)."""
    torch.manual_seed(0)
    idx = torch.randint(0, GPT2_SMALL["vocab_size"], (B, T), device=device)
    return idx, torch.roll(idx, -1, 1)


class PerBlockCheckpoint(torch.nn.Module):
    """Every transformer block under torch.utils.checkpoint (non-reentrant), the common baseline."""

    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


class SDPAAttention(torch.nn.Module):
    """The same attention through F.scaled_dot_product_attention (the 'eager with SDPA' baseline)."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        a = self.attn
        B, T, C = x.size()
        q, k, v = a.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, a.n_head, C // a.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=a.attn_dropout.p if self.training else 0.0,
                                           is_causal=True)
        return a.resid_dropout(a.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


def build(cfg, device, variant, shared_mask=False):
    """GPT ``variant`` ("eager": hand-written attention, "sdpa", "per_block_checkpoint") on ``device``.

    ``shared_mask``: nanoGPT gives every layer its own fp32 ``tril`` buffer, 12 * T^2 * 4 bytes (3 GiB at
    T 8192, 27 GiB at 24576), resident whatever runs the step. For the long-sequence runs every variant
    instead shares one bool ``tril`` (T^2 bytes; the same function), and the SDPA variant has none."""
    torch.manual_seed(0)
    # with a shared mask, no per-layer fp32 tril is ever built (12 x 17 GiB of host memory at T 65536)
    model = GPT(**(dict(cfg, block_size=1) if shared_mask else cfg)).to(device)
    if shared_mask:
        T = cfg["block_size"]
        model.wpe = torch.nn.Embedding(T, cfg["n_embd"]).to(device)
        if variant != "sdpa":   # (4 GiB at T 65536, twice while built: none for the SDPA model)
            tril = torch.ones(T, T, dtype=torch.bool, device=device).tril().view(1, 1, T, T)
            for b in model.h:
                b.attn.bias = tril       # the same tensor in every layer (a buffer of each)
    if variant == "per_block_checkpoint":
        model.h = torch.nn.ModuleList([PerBlockCheckpoint(b) for b in model.h])
    elif variant == "sdpa":
        for b in model.h:
            if shared_mask:
                del b.attn.bias
            b.attn = SDPAAttention(b.attn)
    return model



def llama_config(attn_implementation: str = "sdpa"):
    """The 1.1B LLaMA config: hidden 2048, 16 layers, 16 heads, 8 kv heads, MLP 5632, vocab 32000."""
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                       intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096,
                       attn_implementation=attn_implementation)


def hf_llama(attn_implementation: str, device="cuda", dtype=torch.bfloat16):
    """LlamaForCausalLM of ``llama_config`` (1.1B)."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(attn_implementation)).to(device=device, dtype=dtype)


class CausalLMLoss(torch.nn.Module):
    """A Hugging Face causal LM as ``model(idx, targets) -> loss`` (labels are the inputs: HF shifts them)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, idx, targets=None):
        return self.lm(input_ids=idx, labels=idx).loss


def build_llama(cfg: dict, device, variant: str):
    """HF LLaMA of ``llama_config`` with ``cfg`` overriding it (SDPA attention, as HF loads it; fp32
    weights for autocast), as ``CausalLMLoss``; ``variant="per_block_checkpoint"`` turns on HF's
    ``gradient_checkpointing_enable()``."""
    from transformers import LlamaForCausalLM
    config = llama_config("sdpa")
    for k, v in cfg.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    lm = LlamaForCausalLM(config).to(device)
    if variant == "per_block_checkpoint":
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return CausalLMLoss(lm.train())

