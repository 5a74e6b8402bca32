"""Held-out Hugging Face mixture-of-experts models (tiny configs, CPU, fp32) with each experts
implementation they offer: how many graphs opsmath captures (1: no break per expert), what it did to the
experts (its notes, the experts rewrites, the declines), the loss difference to eager and the worst
parameter gradient error ``||g - g_eager|| / (||g_eager|| + 1e-3 max ||g_eager||)``.

    python -m benchmarks hf_moe_coverage [--amp-fp8] [model ...]

``--amp-fp8``: fp32 weights under CPU bf16 autocast, ``optimize(model, fp8=True)``, the default experts
implementation only, twice: as priced (``fp8_pays``: bf16 grouped GEMMs at these sizes) and with FP8
forced: the experts GEMMs in each dtype, the declines, the errors against eager under the same autocast
(outside the tolerance rule) beside eager-autocast's against fp32 eager.
"""
import copy

import torch
import transformers as T

import opsmath
import sys

from benchmarks.hf_coverage import main, worst_grad_error

SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128)
MODELS = {  # name: (model class, config class, config)
 "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(SMALL, num_local_experts=4, num_experts_per_tok=2)),
 "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(SMALL, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, shared_expert_intermediate_size=64)),
 "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(SMALL, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, head_dim=16)),
 "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(SMALL, num_experts=8, num_experts_per_tok=2)),
 "phimoe": ("PhimoeForCausalLM", "PhimoeConfig", dict(SMALL, num_local_experts=4, num_experts_per_tok=2)),
 "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(SMALL, num_local_experts=4, num_experts_per_tok=2)),
 "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(SMALL, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                 q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1)),
 "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(SMALL, num_local_experts=4, num_experts_per_tok=2, head_dim=16)),
}


def check(cls, cfg_cls, kw, impl) -> str:
    torch.manual_seed(0)
    try:
        model = getattr(T, cls)(getattr(T, cfg_cls)(experts_implementation=impl, **kw)).train()
    except Exception as ex:   # the model does not offer this implementation
        return f"not built ({type(ex).__name__}: {str(ex)[:60]})"
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    opt = opsmath.optimize(model)
    ids = torch.randint(0, 128, (2, 20))
    torch.manual_seed(1)        # the same draws for routers that sample in training (PhiMoE's sparsemixer)
    loss = opt(input_ids=ids, labels=ids).loss
    torch.manual_seed(1)
    loss_e = eager(input_ids=ids, labels=ids).loss
    loss.backward()
    loss_e.backward()
    grad = worst_grad_error(opt, eager)
    rep = opsmath.report(opt)
    declines = sorted({d.reason[:60] for d in rep.declines if d.pattern == "experts"})
    notes = "switched to grouped_mm" if any("switched to its 'grouped_mm'" in n for n in rep.notes) else \
        "kept eager experts" if any("keeps experts_implementation" in n for n in rep.notes) else ""
    return (f"graphs {len(rep.graphs)}  experts rewrites {rep.count('experts')} {notes}  dloss "
            f"{(loss - loss_e).abs().item():.1e}  dgrad {grad:.1e}  fallbacks {len(rep.fallback_errors)}  "
            f"declines {declines}")


def check_amp_fp8(cls, cfg_cls, kw, impl) -> str:
    from contextlib import nullcontext
    from unittest import mock
    out = []
    for forced in (False, True):
        with mock.patch("opsmath.patterns.fp8_experts.fp8_pays", lambda *a: True) if forced else nullcontext():
            out.append(("FP8 forced: " if forced else "as priced: ") + _amp_fp8(cls, cfg_cls, kw))
    return "\n    ".join(out)


def _amp_fp8(cls, cfg_cls, kw) -> str:
    torch.manual_seed(0)
    model = getattr(T, cls)(getattr(T, cfg_cls)(**kw)).train()
    reference, eager = copy.deepcopy(model), copy.deepcopy(model)
    torch._dynamo.reset()
    opt = opsmath.optimize(model, fp8=True)
    ids = torch.randint(0, 128, (2, 16))
    losses = []
    for m, amp in ((opt, True), (eager, True), (reference, False)):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            losses.append(m(input_ids=ids, labels=ids).loss)
        losses[-1].backward()
    rep = opsmath.report(opt)
    declines = sorted({d.reason[:60] for d in rep.declines if d.pattern == "fp8_experts"})
    kinds = [m.details.get("dtype") for m in rep.matches if m.pattern == "fp8_experts"]
    return (f"graphs {len(rep.graphs)}  expert GEMMs fp8 {kinds.count('fp8')} bf16 {kinds.count('bf16')} "
            f"({rep.count('experts')} experts rewrites)  dloss {(losses[0] - losses[1]).abs().item():.1e}  dgrad "
            f"{worst_grad_error(opt, eager):.1e} (eager autocast vs fp32 {worst_grad_error(eager, reference):.1e})  "
            f"fallbacks {len(rep.fallback_errors)}  declines {declines}")


if __name__ == "__main__":
    if "--amp-fp8" in sys.argv:
        sys.argv.remove("--amp-fp8")
        main(MODELS, ("default",), check_amp_fp8)
    else:
        main(MODELS, ("eager", "grouped_mm"), check)
