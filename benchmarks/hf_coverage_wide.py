"""More held-out Hugging Face architectures for ``hf_coverage``'s check (tiny configs, CPU, fp32; ``--amp``: fp32
weights under CPU bf16 autocast): hybrids of attention with linear attention or state-space layers (Qwen3.5,
Qwen3-Next, Falcon-H1, Zamba2, NemotronH, LFM2-MoE), multi-head latent attention (Mistral4, GLM-4-MoE-Lite,
DeepSeek-V3.2 with its indexer, LongCat-Flash with zero experts), chunked and NoPE attention (Llama 4), Gemma 4
(per-layer inputs, KV sharing, K=V, its MoE block), mixtures of experts (DBRX, MiniMax-M2, ERNIE-4.5-MoE,
Cohere2-MoE, EXAONE-MoE, Solar-Open, FlexOlmo) and BLT (a byte-level model with an entropy patcher).

    python -m benchmarks hf_coverage_wide [--amp] [model ...]
"""

from benchmarks.hf_coverage import main

S = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         intermediate_size=128)
MODELS = {
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", dict(S, head_dim=16, intermediate_size_mlp=128,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=2,
        attention_chunk_size=8)),
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(S, head_dim=16, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention",
        "full_attention"])),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(S, head_dim=16, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention",
        "full_attention"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(S, head_dim=16, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention",
        "full_attention"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
    "gemma4": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(S, head_dim=16, global_head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=16)),
    "ministral3": ("Ministral3ForCausalLM", "Ministral3Config", dict(S, head_dim=16, sliding_window=8)),
    "mistral4": ("Mistral4ForCausalLM", "Mistral4Config", dict(S, num_key_value_heads=4, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1)),
    "dbrx": ("DbrxForCausalLM", "DbrxConfig", dict(vocab_size=128, d_model=64, n_heads=4, n_layers=2,
        max_seq_len=64, attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
        ffn_config=dict(hidden_size=64, ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2))),
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig", dict(S, num_key_value_heads=4,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)),
    "lfm2_moe": ("Lfm2MoeForCausalLM", "Lfm2MoeConfig", dict(S, moe_intermediate_size=32, num_dense_layers=1,
        num_experts=4, num_experts_per_tok=2, layer_types=["conv", "full_attention"])),
    "minimax_m2": ("MiniMaxM2ForCausalLM", "MiniMaxM2Config", dict(S, head_dim=16, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2)),
    "falcon_h1": ("FalconH1ForCausalLM", "FalconH1Config", dict(S, mamba_d_ssm=128, mamba_n_heads=8,
        mamba_d_state=8, mamba_chunk_size=8, mamba_d_conv=4)),
    "nemotron_h": ("NemotronHForCausalLM", "NemotronHConfig", dict(vocab_size=128, hidden_size=64,
        num_hidden_layers=None, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], ssm_state_size=8, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=1, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, use_mamba_kernels=False)),
    "deepseek_v32": ("DeepseekV32ForCausalLM", "DeepseekV32Config", dict(S, num_key_value_heads=4,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, first_k_dense_replace=1,
        index_topk=8, index_head_dim=16, index_n_heads=4)),
    "ernie4_5_moe_b": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(S, moe_num_experts=4, moe_k=2,
        moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1)),
    "zamba2": ("Zamba2ForCausalLM", "Zamba2Config", dict(S, layers_block_type=["mamba", "hybrid"], mamba_d_state=8,
        n_mamba_heads=8, chunk_size=8, use_mamba_kernels=False, adapter_rank=8)),
    "cohere2_moe": ("Cohere2MoeForCausalLM", "Cohere2MoeConfig", dict(S, head_dim=16, sliding_window=6,
        num_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])),
    "apertus1p5": ("Apertus1p5TextForCausalLM", "Apertus1p5TextConfig", S),
    "exaone_moe": ("ExaoneMoeForCausalLM", "ExaoneMoeConfig", dict(S, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2)),
    "solar_open": ("SolarOpenForCausalLM", "SolarOpenConfig", dict(S, head_dim=16, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2)),
    "flex_olmo": ("FlexOlmoForCausalLM", "FlexOlmoConfig", dict(S, pad_token_id=0, num_experts=4,
        num_experts_per_tok=2)),
    "longcat_flash": ("LongcatFlashForCausalLM", "LongcatFlashConfig", dict(vocab_size=128, hidden_size=64,
        num_layers=1, num_attention_heads=4, num_key_value_heads=4, ffn_hidden_size=128, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, moe_topk=2,
        n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=32)),
}
# Gemma 4's optional features: final logit softcapping, KV sharing across layers, K=V global attention, its MoE block
G4 = dict(S, head_dim=16, global_head_dim=32, sliding_window=8, vocab_size_per_layer_input=128,
    hidden_size_per_layer_input=16)
MODELS.update({
    "gemma4_softcap_kvshare": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(G4, num_hidden_layers=3,
        final_logit_softcapping=30.0, num_kv_shared_layers=1, layer_types=["sliding_attention", "full_attention",
        "full_attention"])),
    "gemma4_keqv_moe": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(G4, attention_k_eq_v=True,
        num_global_key_value_heads=1, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32, layer_types=["sliding_attention", "full_attention"])),
})
# BLT: byte-level; an entropy patcher (frozen), local encoder and decoder with cross-attention, a global model
_blt = lambda **k: dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, **k)
MODELS["blt"] = ("BltForCausalLM", "BltConfig", dict(vocab_size=260, use_cache=False, patch_size=4,
    patching_threshold=1.0, max_patch_length=4, local_attention_window_len=8, cross_attn_k=2,
    encoder_hash_byte_group_size=[3, 4], encoder_hash_byte_group_vocab=512, patcher_config=_blt(num_hidden_layers=1,
    vocab_size=260, sliding_window=8), encoder_config=_blt(num_hidden_layers=1, vocab_size=260,
    hidden_size_global=128, cross_attn_k=2), decoder_config=_blt(num_hidden_layers=1, vocab_size=260,
    hidden_size_global=128, cross_attn_k=2), global_config=dict(hidden_size=128, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, num_hidden_layers=1)))


if __name__ == "__main__":
    main(MODELS)
