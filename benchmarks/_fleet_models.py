"""The fleet's models (``benchmarks/fleet.py``): each architecture's model and config classes, its config as
measured (0.1-0.4B parameters; ``--width 2`` doubles widths and head counts), a tiny override for CPU smoke
runs, and its inputs' kind and shape; ``config`` builds the config kwargs and checks them against the class."""
from __future__ import annotations

import inspect

DEC = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
           intermediate_size=2816, vocab_size=32000, max_position_embeddings=4096, attention_dropout=0.0)
DEC_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256, max_position_embeddings=64)
ENC = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, intermediate_size=4096,
           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ENC_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
LM, LM_TINY = dict(B=4, T=1024), dict(B=2, T=32)
MODELS = {  # name: (model class, config class, config, its tiny overrides, inputs, shape, tiny shape)
    "llama": ("LlamaForCausalLM", "LlamaConfig", DEC, DEC_TINY, "lm", LM, LM_TINY),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(DEC, sliding_window=512),
                dict(DEC_TINY, sliding_window=16), "lm", LM, LM_TINY),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", DEC, DEC_TINY, "lm", LM, LM_TINY),
    # Gemma-2-shaped: heads of 128, GQA 8/4, softcaps 50 / 30 (defaults), every other layer a window of 512
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        DEC, num_attention_heads=8, num_key_value_heads=4, head_dim=128, intermediate_size=4096,
        query_pre_attn_scalar=128, sliding_window=512),
        dict(DEC_TINY, head_dim=16, query_pre_attn_scalar=16, sliding_window=16), "lm", LM, LM_TINY),
    # Phi-3-mini-shaped: fused qkv and gate-up projections, full multi-head attention; its pad id is 32000
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(
        DEC, num_key_value_heads=16, vocab_size=32064, resid_pdrop=0.0, embd_pdrop=0.0),
        dict(DEC_TINY, num_key_value_heads=4, pad_token_id=0), "lm", LM, LM_TINY),
    "neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, intermediate_size=4096, vocab_size=50304,
        max_position_embeddings=4096, hidden_dropout=0.0, attention_dropout=0.0),
        dict(ENC_TINY, vocab_size=256, max_position_embeddings=64), "lm", LM, LM_TINY),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(
        n_embd=1024, n_layer=8, n_head=16, n_positions=1024, vocab_size=50257, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0), dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=256), "lm", LM, LM_TINY),
    "bert": ("BertForMaskedLM", "BertConfig", dict(ENC, vocab_size=30522, max_position_embeddings=512),
             dict(ENC_TINY, vocab_size=256, max_position_embeddings=64), "mlm", dict(B=16, T=512), dict(B=4, T=32)),
    # problem_type as HF's loss sets it at the first call (else the mutated config recompiles step 2)
    "vit": ("ViTForImageClassification", "ViTConfig", dict(ENC, image_size=224, patch_size=16, num_labels=1000,
            problem_type="single_label_classification"),
            dict(ENC_TINY, image_size=32, patch_size=8, num_labels=10), "image", dict(B=32), dict(B=2)),
    # T5 v1.1-shaped (gated GELU), 6 encoder and 6 decoder layers; the labels shifted right start with
    # decoder_start_token_id (T5's checkpoints set it: 0, the pad id; T5Config has no default)
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(
        d_model=1024, d_kv=64, num_heads=16, d_ff=2816, num_layers=6, num_decoder_layers=6, vocab_size=32128,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, decoder_start_token_id=0),
        dict(d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2, num_decoder_layers=2, vocab_size=256),
        "seq2seq", dict(B=8, T=512, labels=128), dict(B=2, T=32, labels=16)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        DEC, intermediate_size=1408, num_local_experts=8, num_experts_per_tok=2),
        dict(DEC_TINY, intermediate_size=64, num_local_experts=4), "lm", LM, LM_TINY),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        DEC, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=2048),
        dict(DEC_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=64), "lm", LM, LM_TINY),
}
# ~1B members of the coverage harness at their default settings, run when named (not in the default list):
# OLMo-2-1B's and Qwen3-1.7B's shapes (hf_coverage's held-out families: q/k norms, tied embeddings) and timm's
# ViT-g/14 (timm_coverage; "timm:" builds with timm.create_model, the loss taken outside the model)
AT_1B = {
    "olmo2_1b": ("Olmo2ForCausalLM", "Olmo2Config", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, intermediate_size=8192,
        vocab_size=100352, max_position_embeddings=4096, attention_dropout=0.0), DEC_TINY, "lm", LM, LM_TINY),
    "qwen3_1b7": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=6144, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
        attention_dropout=0.0), dict(DEC_TINY, head_dim=16), "lm", LM, LM_TINY),
    "vit_g_timm": ("timm:vit_giant_patch14_224", None, dict(num_classes=1000),
                   dict(embed_dim=64, depth=2, num_heads=4, img_size=32, patch_size=8, num_classes=10),
                   "timm_image", dict(B=32), dict(B=2)),
}
ALL = {**MODELS, **AT_1B}

EXTRA = {"num_labels", "decoder_start_token_id"}   # config attributes the config classes take as **kwargs


WIDE = ("hidden_size", "intermediate_size", "n_embd", "d_model", "d_ff", "num_attention_heads", "n_head", "num_heads",
        "num_key_value_heads", "moe_intermediate_size", "shared_expert_intermediate_size")   # what --width multiplies


def config(name: str, smoke: bool, width: int = 1) -> dict:
    """The config kwargs of ``name``, its widths and head counts times ``width``; every key must be a
    parameter of the config class (transformers 5 accepts unknown keys silently, so a misspelt one would
    change nothing), but for ``EXTRA``."""
    import transformers
    _, cfg_cls, cfg, tiny, *_ = ALL[name]
    cfg = dict(cfg, **tiny) if smoke else dict(cfg)
    cfg.update({k: v * width for k, v in cfg.items() if k in WIDE and cfg_cls is not None})
    if cfg_cls is None:   # timm: create_model checks its own keyword arguments
        return cfg
    unknown = set(cfg) - set(inspect.signature(getattr(transformers, cfg_cls).__init__).parameters) - EXTRA
    if unknown:
        raise TypeError(f"{cfg_cls} has no parameters {sorted(unknown)}")
    return cfg
