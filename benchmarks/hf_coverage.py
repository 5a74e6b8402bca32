"""Held-out Hugging Face models (tiny configs, CPU, fp32) with eager and with SDPA attention, a batch
with left and right padding: how many attention layers opsmath rewrites, the loss difference to eager, and the worst parameter
gradient error ``||g - g_eager|| / (||g_eager|| + 1e-3 max ||g_eager||)`` (the atol keeps gradients that
are zero in exact arithmetic, a key projection's bias under softmax, from reading as errors), and the
attention declines with their reasons; the graphs captured, the graph breaks, and whether the LM head and
its loss were fused (``lce 1``: they were in one graph). Every model has 2 layers: ``attn 2`` is full coverage.

    python -m benchmarks hf_coverage [--more] [--amp] [model ...]

``--priced``: a stress test of priced rewrites' graph surgery (``rewrite/price.py``): on the Inductor
path with ``OPSMATH_PRICE=1``, each priced occurrence given a random verdict (its sides run op by op, the
whole graph too), so about half are put back; the row adds how many were kept and put back.

``--loss-head``: opsmath on the Inductor path (as on CUDA), SDPA models only, with the loss head split off at
any size (``capture/loss_head.MIN_BYTES = 0``; the tiny models' logits are far below the real threshold):
``graphs 2`` where the head became a graph of its own, its loss and gradients against eager's.

``--amp``: both sides under ``torch.autocast("cpu", dtype=torch.bfloat16)`` with fp32 weights, and beside
each row opsmath's and eager's errors against eager in fp32 (the tolerance rule's form: a fused op that
keeps more precision than eager's bf16 intermediates differs from eager by more than from fp32) and
every family rewritten.
"""
import copy
import sys

import torch
import transformers as T

import opsmath

torch.manual_seed(0)
SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
MODELS = {  # name: (model class, config class, config)
 "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(SMALL, num_key_value_heads=2, head_dim=16)),
 "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(SMALL, num_key_value_heads=2, head_dim=16, sliding_window=8)),
 "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(SMALL, num_key_value_heads=2, head_dim=16)),
 "phi": ("PhiForCausalLM", "PhiConfig", dict(SMALL, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
 "stablelm": ("StableLmForCausalLM", "StableLmConfig", dict(SMALL, num_key_value_heads=2)),
 "opt": ("OPTForCausalLM", "OPTConfig", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, dropout=0.0, attention_dropout=0.0, word_embed_proj_dim=64)),
 "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
 "codegen": ("CodeGenForCausalLM", "CodeGenConfig", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
 "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", dict(SMALL, num_key_value_heads=2, residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0)),
 "cohere": ("CohereForCausalLM", "CohereConfig", dict(SMALL, num_key_value_heads=2)),
 "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(SMALL, num_key_value_heads=2)),
 "granite": ("GraniteForCausalLM", "GraniteConfig", dict(SMALL, num_key_value_heads=2)),
 "gpt_bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
 "roberta": ("RobertaForMaskedLM", "RobertaConfig", dict(SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
 "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig", dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, hidden_dim=128, dropout=0.0, attention_dropout=0.0)),
 "deberta_v2": ("DebertaV2ForMaskedLM", "DebertaV2Config", dict(SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16, max_relative_positions=32,
                norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False)),
 "mistral_sw": ("MistralForCausalLM", "MistralConfig", dict(SMALL, num_key_value_heads=2, sliding_window=8)),
 # sliding windows in other spellings of the same idea (per-layer types, use_sliding_window, MoE)
 "phi3_sw": ("Phi3ForCausalLM", "Phi3Config", dict(SMALL, num_key_value_heads=2, sliding_window=7, pad_token_id=0)),
 "starcoder2_sw": ("Starcoder2ForCausalLM", "Starcoder2Config", dict(SMALL, num_key_value_heads=2, sliding_window=6, residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0)),
 "qwen2_sw": ("Qwen2ForCausalLM", "Qwen2Config", dict(SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=0)),
 "mixtral_sw": ("MixtralForCausalLM", "MixtralConfig", dict(SMALL, num_key_value_heads=2, sliding_window=9, num_local_experts=4, num_experts_per_tok=2)),
 "cohere2": ("Cohere2ForCausalLM", "Cohere2Config", dict(SMALL, num_key_value_heads=2, sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
 # ALiBi (BLOOM in baddbmm, Falcon, MPT), partial rotary, encoder-decoders, MoE with a shared expert
 "bloom": ("BloomForCausalLM", "BloomConfig", dict(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)),
 "falcon": ("FalconForCausalLM", "FalconConfig", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True, new_decoder_architecture=False, multi_query=False, hidden_dropout=0.0, attention_dropout=0.0)),
 "mpt": ("MptForCausalLM", "MptConfig", dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, expansion_ratio=2, max_seq_len=64)),
 "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(SMALL, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0)),
 "persimmon": ("PersimmonForCausalLM", "PersimmonConfig", dict(SMALL, hidden_dropout=0.0, attention_dropout=0.0)),
 "t5": ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)),
 "bart": ("BartForConditionalGeneration", "BartConfig", dict(vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, dropout=0.0, attention_dropout=0.0, max_position_embeddings=64)),
 "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(SMALL, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)),
 "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(SMALL, num_key_value_heads=2, head_dim=16, sliding_window=6, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, query_pre_attn_scalar=16)),
 # multi-head latent attention: Q/K head dim 24 (16 + 8 rotary), V head dim 16; routed experts
 # attention sinks (a learned logit per head in the softmax), on a full and a sliding-window layer
 "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(SMALL, num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
 "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(SMALL, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1)),
}

# more held-out families (``--more``): the same check; configs without dropout or router noise, which draw
# from the RNG differently on each side
S = dict(SMALL, num_key_value_heads=2)
MORE = {
 "llama": ("LlamaForCausalLM", "LlamaConfig", S),
 "mistral": ("MistralForCausalLM", "MistralConfig", S),
 "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", S),
 "olmo": ("OlmoForCausalLM", "OlmoConfig", S),
 "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(S, num_experts=4, num_experts_per_tok=2)),
 "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(S, num_local_experts=4, num_experts_per_tok=2)),
 "jetmoe": ("JetMoeForCausalLM", "JetMoeConfig", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
 "phimoe": ("PhimoeForCausalLM", "PhimoeConfig", dict(S, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)),
 "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(S, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)),
 "glm": ("GlmForCausalLM", "GlmConfig", dict(S, head_dim=16, pad_token_id=0)),
 "glm4": ("Glm4ForCausalLM", "Glm4Config", dict(S, head_dim=16, pad_token_id=0)),
 "helium": ("HeliumForCausalLM", "HeliumConfig", dict(S, head_dim=16)),
 "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", dict(S, pad_token_id=0)),
 "exaone4": ("Exaone4ForCausalLM", "Exaone4Config", dict(S, sliding_window=6)),
 "ernie4_5": ("Ernie4_5ForCausalLM", "Ernie4_5Config", dict(S, head_dim=16)),
 "arcee": ("ArceeForCausalLM", "ArceeConfig", S),
 "seed_oss": ("SeedOssForCausalLM", "SeedOssConfig", dict(S, head_dim=16, attention_dropout=0.0, residual_dropout=0.0)),
 "nemotron": ("NemotronForCausalLM", "NemotronConfig", dict(S, head_dim=16)),
 "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
 "gpt_neo": ("GPTNeoForCausalLM", "GPTNeoConfig", dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=5, resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0)),
 "biogpt": ("BioGptForCausalLM", "BioGptConfig", dict(SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
 "xglm": ("XGLMForCausalLM", "XGLMConfig", dict(vocab_size=128, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)),
 "bert": ("BertForMaskedLM", "BertConfig", dict(SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
 "electra": ("ElectraForMaskedLM", "ElectraConfig", dict(SMALL, embedding_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
 "modernbert": ("ModernBertForMaskedLM", "ModernBertConfig", dict(SMALL, global_attn_every_n_layers=2, local_attention=8, embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0, pad_token_id=0)),
 "mbart": ("MBartForConditionalGeneration", "MBartConfig", dict(vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, dropout=0.0, attention_dropout=0.0, max_position_embeddings=64)),
 "falcon_new": ("FalconForCausalLM", "FalconConfig", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True, hidden_dropout=0.0, attention_dropout=0.0)),
 "minimax": ("MiniMaxForCausalLM", "MiniMaxConfig", dict(S, head_dim=16, num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention", "full_attention"])),
 "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(S, num_local_experts=4, num_experts_per_tok=2)),
 "hunyuan_dense": ("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", dict(S, head_dim=16)),
 "apertus": ("ApertusForCausalLM", "ApertusConfig", S),
 "doge": ("DogeForCausalLM", "DogeConfig", dict(S)),
 "bitnet": ("BitNetForCausalLM", "BitNetConfig", S),
 "ministral": ("MinistralForCausalLM", "MinistralConfig", dict(S, head_dim=16, sliding_window=8)),
 "olmo3": ("Olmo3ForCausalLM", "Olmo3Config", dict(S, sliding_window=8)),
 "vaultgemma": ("VaultGemmaForCausalLM", "VaultGemmaConfig", dict(S, head_dim=16, sliding_window=8)),
 "dots1": ("Dots1ForCausalLM", "Dots1Config", dict(S, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
           first_k_dense_replace=1, moe_intermediate_size=32, n_shared_experts=1)),
 "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(S, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
              first_k_dense_replace=1, moe_intermediate_size=32)),
 "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(S, moe_num_experts=4, moe_k=2,
                  moe_intermediate_size=32)),
 "hunyuan_moe": ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config", dict(S, head_dim=16, num_experts=4, moe_topk=2)),
 "diffllama": ("DiffLlamaForCausalLM", "DiffLlamaConfig", S),
 "cwm": ("CwmForCausalLM", "CwmConfig", dict(S, head_dim=16, sliding_window=8)),
 "nanochat": ("NanoChatForCausalLM", "NanoChatConfig", S),
 "roberta_lm": ("RobertaForCausalLM", "RobertaConfig", dict(SMALL, is_decoder=True, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)),
 "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(S, num_key_value_heads=4, n_routed_experts=4,
                 num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32, kv_lora_rank=16,
                 q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
 "granite_moe_shared": ("GraniteMoeSharedForCausalLM", "GraniteMoeSharedConfig", dict(S, num_local_experts=4,
                        num_experts_per_tok=2, shared_intermediate_size=32)),
 # state-space and hybrid models: Mamba's scan through torch's associative_scan (vmap under dynamo: the graph
 # is not lowered, and runs as torch.compile would), Mamba-2's chunked scan, RWKV, RG-LRU, short convolutions
 "mamba": ("MambaForCausalLM", "MambaConfig", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, state_size=8)),
 "falcon_mamba": ("FalconMambaForCausalLM", "FalconMambaConfig", dict(vocab_size=128, hidden_size=64,
                  num_hidden_layers=2, state_size=8)),
 "mamba2": ("Mamba2ForCausalLM", "Mamba2Config", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, state_size=8,
            num_heads=8, head_dim=16, n_groups=1, chunk_size=8)),
 "jamba": ("JambaForCausalLM", "JambaConfig", dict(S, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
           expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, use_mamba_kernels=False)),
 "bamba": ("BambaForCausalLM", "BambaConfig", dict(S, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
           mamba_d_state=8, mamba_chunk_size=8)),
 "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", dict(S, layer_types=["mamba", "attention"],
                      num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8,
                      mamba_chunk_size=8, shared_intermediate_size=64)),
 "lfm2": ("Lfm2ForCausalLM", "Lfm2Config", dict(S, layer_types=["conv", "full_attention"])),
 "rwkv": ("RwkvForCausalLM", "RwkvConfig", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2,
          attention_hidden_size=64, intermediate_size=128, context_length=32)),
 "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", dict(S, num_hidden_layers=3, lru_width=64,
                     attention_window_size=8, block_types=["recurrent", "attention", "recurrent"])),
}


AMP = [False]   # ``--amp``: both sides under CPU bf16 autocast, fp32 weights (the mixed-precision recipe)
PRICED = [False]   # ``--priced``: random verdicts for priced occurrences (``random_verdicts``)
INDUCTOR = [False]   # ``--loss-head``: the Inductor path, the loss head split off at any size


def random_verdicts() -> None:
    """Priced rewrites on, decided at random (seeded): the graph surgery under test, not Inductor."""
    import os
    import random
    import tempfile

    from opsmath.rewrite import price
    from opsmath.runtime import backend
    os.environ.update(OPSMATH_PRICE="1", OPSMATH_CACHE_DIR=tempfile.mkdtemp(prefix="opsmath-priced-"))
    backend.compile_fx = lambda gm, example_inputs, **kw: gm
    price.COMPILE = lambda gm, inputs: gm
    rng = random.Random(0)
    price.MEASURE = lambda fn: (fn(), rng.random())[1]


def check(cls, cfg_cls, kw, attn) -> str:
    try:
        model = getattr(T, cls)(getattr(T, cfg_cls)(attn_implementation=attn, **kw)).train()
    except Exception as ex:   # the model does not offer this attention implementation
        return f"not built ({type(ex).__name__})"
    eager, reference = copy.deepcopy(model), copy.deepcopy(model)
    torch._dynamo.reset()
    opt = opsmath.optimize(model, inductor=True if PRICED[0] or INDUCTOR[0] else None)
    ids = torch.randint(0, 128, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :3] = 0    # left padding: under a causal mask the first rows see no key at all
    mask[1, 14:] = 0   # right padding

    def step(m, amp):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = m(input_ids=ids, labels=ids, attention_mask=mask).loss
        loss.backward()
        return loss.detach().float()
    loss, loss_e = step(opt, AMP[0]), step(eager, AMP[0])
    grad = worst_grad_error(opt, eager)
    rep = opsmath.report(opt)
    declines = sorted({d.reason[:70] for d in rep.declines if d.pattern == "attention"})
    windows = [m.details.get("window", 0) for m in rep.matches if m.pattern == "attention"]
    line = (f"attn {rep.count('attention')}  dloss {(loss - loss_e).abs().item():.1e}  dgrad {grad:.1e}  "
            f"fallbacks {len(rep.fallback_errors)}  declines {declines}  windows {windows}  graphs {len(rep.graphs)}  "
            f"breaks {sum(e.kind == 'graph break' for e in rep.eager_regions)}  lce {rep.count('linear_cross_entropy')}")
    if PRICED[0]:
        kept = sum("priced" in m.details for m in rep.matches)
        back = sum("Inductor's fusion" in d.reason for d in rep.declines)
        line += f"  priced: kept {kept}, put back {back}"
    if AMP[0]:   # the tolerance rule's form: each against fp32 eager, opsmath's error beside eager's own
        loss_r = step(reference, False)
        families = sorted({m.pattern for m in rep.matches})
        line += (f"  | amp vs fp32: dloss opsmath {(loss - loss_r).abs().item():.1e} eager "
                 f"{(loss_e - loss_r).abs().item():.1e}  dgrad opsmath {worst_grad_error(opt, reference):.1e} eager "
                 f"{worst_grad_error(eager, reference):.1e}  rewrites {families}")
    return line


def worst_grad_error(opt, eager) -> float:
    """``max ||g - g_eager|| / (||g_eager|| + 1e-3 max ||g_eager||)`` over the parameters."""
    pairs = [(p.grad, q.grad) for p, q in zip(opt.parameters(), eager.parameters()) if q.grad is not None]
    atol = 1e-3 * max(q.norm().item() for _, q in pairs)
    return max((p - q).norm().item() / (q.norm().item() + atol) for p, q in pairs)


def main(models=MODELS, variants=("eager", "sdpa"), check=check):
    """``check(*models[name], variant)`` for each model named on the command line (default: all;
    ``--more``: the ``MORE`` families)."""
    args = sys.argv[1:]
    if "--amp" in args:
        args.remove("--amp")
        AMP[0] = True
    if "--priced" in args:
        args.remove("--priced")
        PRICED[0] = True
        random_verdicts()
    if "--loss-head" in args:
        from opsmath.capture import loss_head
        args.remove("--loss-head")
        INDUCTOR[0], loss_head.MIN_BYTES, variants = True, 0, ("sdpa",)
    if "--more" in args:
        args.remove("--more")
        models = {**models, **MORE} if args else MORE
    for name in args or list(models):
        for variant in variants:
            print(f"{name:12} {variant:10} {check(*models[name], variant)}", flush=True)


if __name__ == "__main__":
    main()
