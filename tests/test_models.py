"""Real, unmodified models in training mode: every attention layer and the norms where the pattern
occurs are rewritten, and with dropout off the loss and every parameter gradient equal eager
(fp32: loss rel. error <= 1e-4, grads <= 2e-3). ``OPSMATH_TEST_DEVICE=cuda`` runs them in bf16 on the
GPU through the Triton kernels (looser bf16 bounds)."""
import copy

import pytest
import torch

import opsmath
from opsmath import examples
from tolerance import grads_close, rel_err

from conftest import DEVICE

transformers = pytest.importorskip("transformers")


_ATTN = ["eager"]   # the attn_implementation _hf builds with (``_default_attention`` switches it)


def _hf(cls_name, cfg_name, **cfg):
    cfg_cls = getattr(transformers, cfg_name)
    config = cfg_cls(attn_implementation=_ATTN[0], **cfg)
    return getattr(transformers, cls_name)(config)


def _default_attention(factory):
    """``factory`` with Hugging Face's default attention ("sdpa": a ``scaled_dot_product_attention`` call)."""
    def make():
        _ATTN[0] = "sdpa"
        try:
            return factory()
        finally:
            _ATTN[0] = "eager"
    return make


def gpt_neox():
    m = _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            intermediate_size=64, vocab_size=100, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0)
    ids = _tokens(100)
    return m, dict(input_ids=ids, labels=ids), 2, 0


def phi3():
    m = _hf("Phi3ForCausalLM", "Phi3Config", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, vocab_size=100, pad_token_id=0)
    ids = _tokens(100)
    return m, dict(input_ids=ids, labels=ids), 2, 0


def gemma2_softcap():
    """Logit softcapping in every layer; alternate layers slide a window (a mask, read as a bias)."""
    m = _hf("Gemma2ForCausalLM", "Gemma2Config", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=100, sliding_window=6,
            attn_logit_softcapping=5.0, final_logit_softcapping=3.0, query_pre_attn_scalar=8, pad_token_id=0)
    ids = _tokens(100)
    return m, dict(input_ids=ids, labels=ids), 2, 0


def falcon_alibi():
    """ALiBi added to the scores of a no-op view, scaled in place (``*=``), HF's additive mask."""
    m = _hf("FalconForCausalLM", "FalconConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            vocab_size=100, alibi=True, new_decoder_architecture=False, multi_query=False,
            hidden_dropout=0.0, attention_dropout=0.0)
    ids = _tokens(100)
    return m, dict(input_ids=ids, labels=ids), 2, 0


def bloom_alibi():
    """ALiBi inside ``baddbmm`` over (B*H) rows, 4-D softmax, ``bmm`` with V flattened again."""
    m = _hf("BloomForCausalLM", "BloomConfig", n_layer=2, hidden_size=32, n_head=4, vocab_size=100,
            hidden_dropout=0.0, attention_dropout=0.0)
    ids = _tokens(100)
    return m, dict(input_ids=ids, labels=ids), 2, 0


def deberta_v2_relative():
    """Disentangled attention (c2p + p2c relative biases) over (B*H) rows, scale a constant tensor."""
    m = _hf("DebertaV2ForMaskedLM", "DebertaV2Config", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            intermediate_size=64, vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=16,
            norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False)
    ids = _tokens(100)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    return m, dict(input_ids=ids, labels=ids, attention_mask=mask), 2, 0


def _tokens(vocab, B=2, T=16):
    return torch.randint(0, vocab, (B, T))


def gpt2():
    m = _hf("GPT2LMHeadModel", "GPT2Config", n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    ids = _tokens(100)
    return m, dict(input_ids=ids, labels=ids), 2, 3


def bert_padding():
    m = _hf("BertForMaskedLM", "BertConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            intermediate_size=64, vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = _tokens(100)
    am = torch.ones_like(ids)
    am[1, 10:] = 0
    return m, dict(input_ids=ids, attention_mask=am, labels=ids), 2, 4


def llama_gqa():
    m = _hf("LlamaForCausalLM", "LlamaConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, vocab_size=100)
    ids = _tokens(100)
    return m, dict(input_ids=ids, labels=ids), 2, 4


def mistral_gqa():
    m = _hf("MistralForCausalLM", "MistralConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            num_key_value_heads=1, intermediate_size=64, vocab_size=100, sliding_window=None)
    ids = _tokens(100)
    return m, dict(input_ids=ids, labels=ids), 2, 4


def qwen2_gqa_bias():
    m = _hf("Qwen2ForCausalLM", "Qwen2Config", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, vocab_size=100)
    ids = _tokens(100)
    return m, dict(input_ids=ids, labels=ids), 2, 4


def mixtral_moe():
    """A mixture of experts (top-2 of 4): routing, per-expert gather/scatter, batched expert weights."""
    m = _hf("MixtralForCausalLM", "MixtralConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, vocab_size=100, num_local_experts=4,
            num_experts_per_tok=2)
    ids = _tokens(100)
    return m, dict(input_ids=ids, labels=ids), 2, 4


def qwen2_moe():
    """Routed experts plus a gated shared expert."""
    m = _hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, vocab_size=100, num_experts=4, num_experts_per_tok=2)
    ids = _tokens(100)
    return m, dict(input_ids=ids, labels=ids), 2, 4


def hf_vit():
    m = _hf("ViTForImageClassification", "ViTConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            intermediate_size=64, image_size=32, patch_size=8, num_labels=5, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
    return m, dict(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.tensor([1, 3])), 2, 0


def t5_relative_bias():
    m = _hf("T5ForConditionalGeneration", "T5Config", num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8,
            num_heads=4, d_ff=64, vocab_size=100, dropout_rate=0.0, decoder_start_token_id=0)
    ids = _tokens(100)
    return m, dict(input_ids=ids, labels=_tokens(100, T=9)), 6, 0


def nanogpt():
    m, (idx, tgt) = examples.gpt(batch_size=2, seq_len=32, dropout=0.0)
    return m, (idx, tgt), 2, 3


def dit_handwritten():
    m, batch = examples.dit(batch_size=2)
    return m, batch, 2, 3


def llama_handwritten():
    m, batch = examples.llama(batch_size=2, seq_len=32)
    return m, batch, 2, 3


def timm_vit():
    timm = pytest.importorskip("timm")
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                          num_classes=5)
    for blk in m.blocks:
        blk.attn.fused_attn = False  # its hand-written attention path
    x = torch.randn(2, 3, 32, 32)

    class WithLoss(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.net(x), y)
    return WithLoss(m), (x, torch.tensor([0, 4])), 2, 0


MODELS = {  # name: factory -> (model, inputs, attention layers, at least this many norm rewrites)
    "nanogpt": nanogpt, "llama_handwritten": llama_handwritten, "hf_gpt2": gpt2, "hf_bert_padding": bert_padding,
    "hf_llama_gqa": llama_gqa, "hf_mistral_mqa": mistral_gqa, "hf_qwen2": qwen2_gqa_bias, "hf_vit": hf_vit,
    "hf_t5": t5_relative_bias, "timm_vit": timm_vit, "hf_mixtral_moe": mixtral_moe, "hf_qwen2_moe": qwen2_moe,
    "dit_handwritten": dit_handwritten, "hf_gpt_neox": gpt_neox, "hf_gemma2_softcap": gemma2_softcap,
    "hf_falcon_alibi": falcon_alibi, "hf_bloom_alibi": bloom_alibi,
    "hf_deberta_v2": deberta_v2_relative,
    # Hugging Face's default attention: one scaled_dot_product_attention call per layer
    **{f"{name}_sdpa": _default_attention(f) for name, f in [
        ("hf_llama_gqa", llama_gqa), ("hf_mistral_mqa", mistral_gqa), ("hf_qwen2", qwen2_gqa_bias),
        ("hf_gpt2", gpt2), ("hf_bert_padding", bert_padding), ("hf_gpt_neox", gpt_neox), ("hf_phi3", phi3),
        ("hf_vit", hf_vit)]},
}


# swiglu / bias_gelu rewrites on the op-by-op path (CPU; under Inductor these are left to it). HF GPT-2's
# "gelu_new" is spelled out in elementwise ops after a Conv1D addmm; T5 uses ReLU: none there.
ACTIVATIONS = {"nanogpt": ("bias_gelu", 2), "llama_handwritten": ("swiglu", 2), "hf_bert_padding": ("bias_gelu", 3),
               "hf_gpt2": ("bias_gelu", 2),
               "hf_llama_gqa": ("swiglu", 2), "hf_mistral_mqa": ("swiglu", 2), "hf_qwen2": ("swiglu", 2),
               "hf_vit": ("bias_gelu", 2), "hf_mixtral_moe": ("swiglu", 2), "hf_qwen2_moe": ("swiglu", 4),
               "dit_handwritten": ("bias_gelu", 2)}


def _loss(model, inputs):
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return out.loss if hasattr(out, "loss") else out


def _to(inputs, device, dtype=None):
    """Inputs on ``device``; floating ones in ``dtype`` when given (integer ids and labels stay)."""
    def to(v):
        return v.to(device, dtype) if dtype is not None and v.is_floating_point() else v.to(device)
    if isinstance(inputs, dict):
        return {k: to(v) for k, v in inputs.items()}
    return tuple(to(v) for v in inputs)


def _reference(pristine, inputs):
    """The high-precision run of the bf16 comparison: fp64, or fp32 where the model cannot run in fp64
    on the GPU (HF's MoE experts use ``torch._grouped_mm``, which has no fp64 kernel)."""
    for dtype in (torch.float64, torch.float32):
        reference = copy.deepcopy(pristine).to(dtype)
        try:
            loss = _loss(reference, _to(inputs, DEVICE, dtype))
        except RuntimeError as e:
            if dtype == torch.float32 or "Double" not in str(e):
                raise
            continue
        loss.backward()
        return reference, loss


@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_rewritten_and_matches_eager(name):
    torch.manual_seed(0)
    model, inputs, n_attn, min_norms = MODELS[name]()
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    model = model.to(DEVICE, dtype).train()
    inputs = _to(inputs, DEVICE, dtype)   # every floating input (images, DiT's latents and noise) in the model's dtype
    eager = copy.deepcopy(model)
    pristine = copy.deepcopy(model) if DEVICE == "cuda" else None

    # op by op on CUDA too: this test is where every opsmath kernel meets real models; the Inductor default
    # (which leaves the memory-bound families to Inductor) is covered by test_inductor.py
    opt = opsmath.optimize(model, inductor=False)
    assert opt is model
    loss = _loss(opt, inputs)
    loss.backward()
    loss_e = _loss(eager, inputs)
    loss_e.backward()

    rep = opsmath.report(opt)
    assert rep.count("attention") == n_attn, rep.render(width=140)
    assert rep.count("dropout_add_norm") >= min_norms, rep.render(width=140)
    if DEVICE == "cpu" and name in ACTIVATIONS:
        assert rep.count(ACTIVATIONS[name][0]) == ACTIVATIONS[name][1], rep.render(width=140)
    if pristine is None:
        assert rel_err(loss, loss_e) <= 1e-4
        for (pname, p), pe in zip(opt.named_parameters(), eager.parameters()):
            if pe.grad is not None:
                assert grads_close(p.grad, pe.grad, 2e-3), pname
    else:  # bf16: opsmath's error vs an fp64 (or fp32) run must stay within 2x eager bf16's (plus slack)
        reference, loss_r = _reference(pristine, inputs)
        assert abs(loss.item() - loss_r.item()) <= 2 * abs(loss_e.item() - loss_r.item()) + 1e-2
        # per parameter: ||g - g64|| <= 2 ||g_eager - g64|| + 1e-2 ||g64|| + atol, with atol 1e-3 of the
        # largest gradient norm in the model (zero-in-exact-arithmetic grads, e.g. a key bias, are noise)
        scale = max(pr.grad.double().norm().item() for pr in reference.parameters() if pr.grad is not None)
        for (pname, p), pe, pr in zip(opt.named_parameters(), eager.parameters(), reference.parameters()):
            if pe.grad is not None:
                g64 = pr.grad.double()
                err, err_e = (p.grad.double() - g64).norm().item(), (pe.grad.double() - g64).norm().item()
                assert err <= 2 * err_e + 1e-2 * g64.norm().item() + 1e-3 * scale, (pname, err, err_e)


def test_state_dict_keys_parameters_and_optimizer():
    torch.manual_seed(0)
    model, batch, _, _ = nanogpt()
    keys = list(model.state_dict())
    params = list(model.parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # made before optimize
    opt = opsmath.optimize(model)
    assert list(opt.state_dict()) == keys
    assert all(a is b for a, b in zip(opt.parameters(), params))
    before = params[0].detach().clone()
    _loss(opt, batch).backward()
    sgd.step()
    assert not torch.equal(before, params[0])


def test_recapture_on_eval_and_new_shapes():
    torch.manual_seed(0)
    model, (idx, tgt), _, _ = nanogpt()
    opt = opsmath.optimize(model)
    _loss(opt, (idx, tgt)).backward()
    opt.eval()
    with torch.no_grad():
        _loss(opt, (idx, tgt))
    opt.train()
    _loss(opt, (idx[:, :20].contiguous(), tgt[:, :20].contiguous())).backward()
    graphs = opsmath.report(opt).graphs
    assert [g.training for g in graphs] == [True, False, True]
    assert all(sum(m.pattern == "attention" for m in g.matches) == 2 for g in graphs)


def test_triton_path_end_to_end(triton_on_cpu):
    """The nanoGPT step through the Triton kernels (interpreter), dropout off, equals eager."""
    torch.manual_seed(0)
    model, batch, _, _ = nanogpt()
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    loss = _loss(opt, batch)
    loss.backward()
    loss_e = _loss(eager, batch)
    loss_e.backward()
    assert rel_err(loss, loss_e) <= 1e-4
    for p, pe in zip(opt.parameters(), eager.parameters()):
        assert grads_close(p.grad, pe.grad, 2e-3)


@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16])
def test_autocast_dtypes_match_eager(amp_dtype):
    """Under autocast the rewritten graph returns the dtypes eager returns, and the loss is close."""
    torch.manual_seed(0)
    model, batch, _, _ = llama_handwritten()
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    with torch.autocast("cpu", dtype=amp_dtype):
        loss = _loss(opt, batch)
        loss_e = _loss(eager, batch)
    assert loss.dtype == loss_e.dtype
    assert abs(loss.item() - loss_e.item()) < 2e-2 * abs(loss_e.item())
    loss.backward()
    assert opsmath.report(opt).count("attention") == 2


def test_grad_scaler_fp16_autocast_trains():
    """fp16 autocast with GradScaler, as users run it: scaled backward through the fused ops, a step
    that changes the weights, finite gradients, loss close to eager's."""
    torch.manual_seed(0)
    model, batch, _, _ = nanogpt()
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    sgd = torch.optim.SGD(opt.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _loss(opt, batch)
        loss_e = _loss(eager, batch)
    assert abs(loss.item() - loss_e.item()) < 2e-2 * abs(loss_e.item())
    before = [p.detach().clone() for p in opt.parameters()]
    scaler.scale(loss).backward()
    scaler.unscale_(sgd)
    assert all(torch.isfinite(p.grad).all() for p in opt.parameters() if p.grad is not None)
    scaler.step(sgd)
    scaler.update()
    assert any(not torch.equal(b, p) for b, p in zip(before, opt.parameters()))
