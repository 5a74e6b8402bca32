"""Hugging Face models as they load by default (``attn_implementation="sdpa"``): a training step under
``torch.compile`` vs ``opsmath.optimize``, interleaved in one process.

Both variants are built from one seed and trained on the same batch, torch fused AdamW, in the recipe
``--recipe`` names: ``amp`` (default; fp32 weights, the forward under bf16 autocast, what HF Trainer's
``bf16=True`` runs) or ``bf16`` (bf16 weights).
After two warm-up steps each (capture, compile, attention tuning), the variants alternate: ``--rounds``
rounds of ``--steps`` timed steps each, A B A B. Per variant: median and spread (min-max) of the
per-round median step time, GPU kernel time per step (torch.profiler, kernels only), the step's peak
memory above what is resident before it (``max_memory_allocated``), and, for opsmath, what it rewrote.

    python -m benchmarks hf_default_attention [--models llama,neox,gemma2] [--recipe amp|bf16] [--rounds 5] [--steps 5] [--variants ...]
        [--gradient-checkpointing] [--accumulate 1,4]

``--accumulate``: micro-batches per optimizer step; with several, each round times every variant at each.
"""
from __future__ import annotations

import argparse
from collections import Counter

import torch

import opsmath
import opsmath.patterns
from opsmath.api import INDUCTOR_FUSES_BETTER
from benchmarks._harness import Stepper, interleave, kernel_classes, kernel_ms, write

GEMMA2_9B = dict(   # Gemma-2-9B's layers, 4 of them, its vocabulary cut to 32000
    hidden_size=3584, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    intermediate_size=14336, vocab_size=32000, max_position_embeddings=8192, sliding_window=4096,
    attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
    attn_implementation="eager")
MODELS = {  # name: (transformers class, config kwargs, batch, sequence)
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096), 4, 2048),
    "neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
        vocab_size=50304, max_position_embeddings=4096, rotary_pct=0.25, hidden_dropout=0.0,
        attention_dropout=0.0), 8, 2048),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(
        hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096, sliding_window=None), 4, 2048),
    # Mistral-shaped with a sliding window of 1024 keys (Gemma-3's local layers) at sequence 8192: the
    # window removes 7/8 of the causal attention's work, if the kernel skips it
    "mistral_sw": ("MistralForCausalLM", "MistralConfig", dict(
        hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=5632, vocab_size=32000, max_position_embeddings=8192, sliding_window=1024), 1, 8192),
    # Gemma-2-27B's layer shape (head dim 128, logit softcapping 50), 4 layers. Its attention is eager as
    # written (SDPA cannot softcap); "torch.compile (flex_attention)" is HF's flex implementation of it
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        hidden_size=4608, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
        intermediate_size=36864, vocab_size=32000, max_position_embeddings=8192, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=144,
        attn_implementation="eager"), 4, 2048),
    # Gemma-2-9B's layer shape (hidden 3584, 16 heads of 256, GQA 16/8, MLP 14336, softcaps 50 / 30), 4 layers
    "gemma2_9b": ("Gemma2ForCausalLM", "Gemma2Config", GEMMA2_9B, 4, 2048),
    # the same at Gemma-2's native context (B1 T8192): layers 0 and 2 slide a window of 4096 keys
    "gemma2_9b_8k": ("Gemma2ForCausalLM", "Gemma2Config", GEMMA2_9B, 1, 8192),
    # the same layers with Gemma-2's own vocabulary (256000): the LM head and its softcapped loss weigh
    # like a model of about 10 layers (4 layers here; Gemma-2-9B has 42)
    "gemma2_9b_v256k": ("Gemma2ForCausalLM", "Gemma2Config", dict(GEMMA2_9B, vocab_size=256000), 4, 2048),
    # Llama-3-8B's layer shape (hidden 4096, MLP 14336, GQA 32/8), 4 layers, sequence 4096: GEMM-bound
    "llama8b4": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=4096, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=32000, max_position_embeddings=8192), 2, 4096),
    # GPT-OSS-20B's attention (64 heads of 64, GQA 64/8, sinks, sliding window 128 on every other layer),
    # 4 layers, 8 experts top-4 (20B has 32): eager attention as HF offers it (no SDPA)
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        hidden_size=2880, num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        intermediate_size=2880, num_local_experts=8, num_experts_per_tok=4, vocab_size=32000, sliding_window=128,
        max_position_embeddings=4096), 2, 2048),
    # BLOOM-1B7's layer shape (ALiBi slopes added to the scores inside baddbmm, 16 heads of 128), 8 layers:
    # HF's eager attention as BLOOM writes it
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(
        hidden_size=2048, n_layer=8, n_head=16, vocab_size=32000, hidden_dropout=0.0, attention_dropout=0.0), 4, 2048),
    # the same 1.1B at a small batch: activations small beside the 4.4 GB of fp32 gradients, the step's
    # peak in backward (what AdamW(in_backward=True) lowers)
    "llama_b1": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096), 1, 512),
    "tiny": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256), 2, 32),
}


def build(name, device, checkpointing=False, attn=None, seed=0):
    """The model in the recipe's weights: fp32 under ``--recipe amp`` (autocast computes in bf16), else bf16
    on CUDA."""
    import transformers
    cls, cfg_cls, cfg, _, _ = MODELS[name]
    torch.manual_seed(seed)
    cfg = dict(cfg, **({"attn_implementation": attn} if attn else {}))
    model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**cfg))   # default attention
    if checkpointing:   # as fine-tuning recipes turn it on: every decoder layer recomputed in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    dtype = torch.bfloat16 if device == "cuda" and RECIPE[0] == "bf16" else torch.float32
    return model.to(device=device, dtype=dtype).train()


RECIPE = ["amp"]   # "amp": fp32 weights, forward under bf16 autocast (HF Trainer bf16=True); "bf16": bf16 weights


class Variant(Stepper):
    """A Hugging Face model and torch fused AdamW in ``RECIPE``, stepped on one batch (``Stepper``: warm-up
    and timed rounds, alternated with the other variants by ``interleave``)."""

    def __init__(self, label, model, batch, device):
        super().__init__(label, device)
        self.model, self.batch = model, batch
        self.amp = RECIPE[0] == "amp"
        self.opt = OPTIMIZERS.get(label, _torch_adamw)(model.parameters(), device)

    def step(self, accumulate: int = 1):
        """One optimizer step over ``accumulate`` micro-batches (the same batch each time)."""
        for _ in range(accumulate):
            with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.amp):
                loss = self.model(**self.batch).loss
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def row(self, accumulate: int = 1, tagged: bool = False):
        r = dict(name=self.label + (f" (accumulate {accumulate})" if tagged else ""), accumulate=accumulate,
                 recipe="fp32 weights, bf16 autocast" if self.amp else "bf16 weights", **self.timing(accumulate),
                 first_step_s=self.first_s, first_loss=self.first_loss)
        if self.device == "cuda":
            per = kernel_ms(lambda: self.step(accumulate), calls=3)
            r["gpu_ms"], r["step_peak_gib"] = sum(per.values()), self.peak_gib
            r["top_kernels"] = sorted(per.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
            r["kernel_classes"] = kernel_classes(per)
        if hasattr(self.model, "_opsmath"):
            casts = self.model._opsmath.weight_casts
            r["fp8_copies_gib"], r["fp8_weight_casts"], r["fp8_copies_reused"] = \
                casts.nbytes() / 2**30, casts.casts, casts.reused
            rep = opsmath.report(self.model)
            r["rewrites"] = dict(Counter(m.pattern for m in rep.matches))
            r["attention_backends"] = sorted({m.details.get("backend", "") for m in rep.matches
                                              if m.pattern == "attention"})
            r["attention_rewrites"] = dict(Counter(m.replacement for m in rep.matches if m.pattern == "attention"))
            r["graphs"], r["fallbacks"] = len(rep.graphs), rep.fallback_errors
            r["kept_as_written"] = [e.to_dict() for e in rep.eager_regions]
        return r


def _torch_adamw(params, device):
    return torch.optim.AdamW(params, lr=1e-5, fused=device == "cuda")


OPTIMIZERS = {  # label: the optimizer its variant steps with (else torch's fused AdamW)
    "opsmath.optimize + opsmath AdamW": lambda params, device: opsmath.optim.AdamW(params, lr=1e-5),
    "opsmath.optimize + opsmath AdamW(in_backward)":
        lambda params, device: opsmath.optim.AdamW(params, lr=1e-5, in_backward=True),
}


def torchao_float8(model):
    """torchao's float8 training (dynamic tensorwise scaling), every linear but the LM head whose
    dims are multiples of 16, then ``torch.compile``: torchao's own recipe (needs torchao installed)."""
    from torchao.float8 import convert_to_float8_training
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "lm_head" and isinstance(
        mod, torch.nn.Linear) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)
    return torch.compile(model)


class SharedInputThresholdOff(torch.nn.Module):
    """An FP8 model captured with every layer held to ``MIN_DIM`` (``SHARED_MIN_DIM`` raised to it while
    it runs): the A/B of the rule that lets k/v (reading q's input) run FP8 from ``SHARED_MIN_DIM``."""

    def __init__(self, model):
        super().__init__()
        self.model, self._opsmath = model, model._opsmath

    def forward(self, **kwargs):
        import opsmath.patterns.fp8_linear as rule
        old, rule.SHARED_MIN_DIM = rule.SHARED_MIN_DIM, rule.MIN_DIM
        try:
            return self.model(**kwargs)
        finally:
            rule.SHARED_MIN_DIM = old


WITH_LOSS = sorted(set(opsmath.patterns.NAMES) - INDUCTOR_FUSES_BETTER - {"fp8_linear"} | {"linear_cross_entropy"})
TOP_KERNELS = 15   # the row keeps its step's most expensive kernels (name, GPU ms per step)
FP8_ALONE = "opsmath.optimize(fp8=True) + CUDA graphs (shared-input rule off)"
VARIANTS = {  # label: (wrap the built model, attn_implementation or None for the model's default)
    "torch.compile": (torch.compile, None),
    "opsmath.optimize": (opsmath.optimize, None),
    # the LM head's loss fused too (left to Inductor by default: INDUCTOR_FUSES_BETTER)
    "opsmath.optimize + fused loss": (lambda m: opsmath.optimize(m, patterns=WITH_LOSS), None),
    "torch.compile (flex_attention)": (torch.compile, "flex_attention"),
    "opsmath.optimize(fp8=True)": (lambda m: opsmath.optimize(m, fp8=True), None),
    "opsmath.optimize + CUDA graphs": (lambda m: opsmath.optimize(m, cuda_graphs=True), None),
    "opsmath.optimize(fp8=True) + CUDA graphs": (lambda m: opsmath.optimize(m, fp8=True, cuda_graphs=True),
                                                     None),
    "opsmath.optimize(fp8=cached)": (lambda m: opsmath.optimize(m, fp8="cached"), None),
    "opsmath.optimize(fp8=cached) + CUDA graphs": (lambda m: opsmath.optimize(m, fp8="cached", cuda_graphs=True), None),
    "opsmath.optimize(fp8=rowwise) + CUDA graphs": (
        lambda m: opsmath.optimize(m, fp8="rowwise", cuda_graphs=True), None),
    "torchao float8 + torch.compile": (torchao_float8, None),
    **{label: (opsmath.optimize, None) for label in OPTIMIZERS},
    FP8_ALONE: (lambda m: SharedInputThresholdOff(opsmath.optimize(m, fp8=True, cuda_graphs=True)), None),
}
# built after the first variant's warm-up, under an absolute memory_budget at the first variant's total
# step peak (``planned``): the model without the user's checkpointing
# (opsmath's plan alone), and with it (the user's regions handed to the plan as candidates)
OWN_PLAN = "opsmath own plan at the same peak"
USER_PLAN = "opsmath plan with the user's checkpoints at the same peak"


def resident_bytes(v: Variant) -> int:
    """Parameters and optimizer state of ``v``: what stays between steps. (Gradients are freed by
    ``zero_grad(set_to_none=True)``, so they are part of the step's peak, ``peak_gib``.)"""
    params = sum(p.numel() * p.element_size() for p in v.model.parameters())
    state = sum(t.numel() * t.element_size() for st in v.opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor))
    return params + state


def planned(label, name, device, first: Variant, batch) -> Variant:
    """The variant ``label`` under the budget that reproduces ``first``'s peak in this process: what is
    allocated now (the other variants; an absolute budget counts the whole process, as
    ``max_memory_allocated`` does), plus ``first``'s resident bytes and its step's peak."""
    budget = int(torch.cuda.memory_allocated() + resident_bytes(first) + first.peak_gib * 2**30)
    print(f"{name} {label}: memory_budget={budget / 2**30:.2f} GiB", flush=True)
    return Variant(label, opsmath.optimize(build(name, device, label == USER_PLAN), memory_budget=budget), batch,
                   device)


def run(name, rounds, steps, device, checkpointing=False, labels=("torch.compile", "opsmath.optimize"),
        accumulate=(1,)):
    _, _, cfg, B, T = MODELS[name]
    torch.manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (B, T), device=device)
    batch = dict(input_ids=ids, labels=ids, use_cache=False)
    torch._dynamo.reset()
    variants = []
    for label in [x for x in labels if x not in (OWN_PLAN, USER_PLAN)]:
        try:   # a variant that fails is reported and left out; the others still run side by side
            v = Variant(label, VARIANTS[label][0](build(name, device, checkpointing, VARIANTS[label][1])), batch,
                        device)
            v.warm_up()
        except Exception as e:  # noqa: BLE001
            print(f"{name} {label}: failed, left out: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        variants.append(v)
        print(f"{name} {v.label}: first step {v.first_s:.1f} s, loss {v.first_loss:.4f}", flush=True)
    for label in [x for x in labels if x in (OWN_PLAN, USER_PLAN) and device == "cuda"]:
        try:
            variants.append(planned(label, name, device, variants[0], batch))
            variants[-1].warm_up()
        except opsmath.InfeasibleBudget as e:   # the plan's floor is above the first variant's peak
            print(f"{name} {label}: {e}", flush=True)
            variants = [v for v in variants if v.label != label]
            torch.cuda.empty_cache()
    interleave(variants, rounds, steps, accumulate)
    rows = [v.row(k, len(accumulate) > 1 or k > 1) for k in accumulate for v in variants]
    for r in rows:   # against the first variant at the same accumulation
        r["speedup_vs_compile"] = next(b for b in rows if b["accumulate"] == r["accumulate"])["ms"] / r["ms"]
        print(f"{name:8} {r['name']:30} {r['ms']:8.2f} ms [{r['ms_min']:.2f}-{r['ms_max']:.2f}] "
              f"gpu {r.get('gpu_ms', 0):8.2f} ms peak {r.get('step_peak_gib', 0):6.2f} GiB "
              f"x{r['speedup_vs_compile']:.3f} {r.get('rewrites', '')} {r.get('attention_backends', '')}",
              flush=True)
        for what, count in r.get("attention_rewrites", {}).items():
            print(f"    {count} x {what}", flush=True)
        for k, ms in r.get("top_kernels", [])[:8]:
            print(f"    {ms:8.3f} ms  {k[:110]}", flush=True)
    return dict(batch=[B, T], config=cfg, gradient_checkpointing=checkpointing, rows=rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama,neox")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="model.gradient_checkpointing_enable() (non-reentrant) on both variants")
    ap.add_argument("--variants", default="torch.compile,opsmath.optimize",
                    help=", ".join([*VARIANTS, OWN_PLAN, USER_PLAN]))
    ap.add_argument("--accumulate", default="1",
                    help="micro-batches per optimizer step; a list (1,4) times each variant at each, interleaved")
    ap.add_argument("--recipe", choices=["amp", "bf16"], default="amp",
                    help="amp: fp32 weights under bf16 autocast (what most users run); bf16: bf16 weights")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, measures nothing")
    args = ap.parse_args()
    RECIPE[0] = args.recipe
    device = "cpu" if args.smoke else "cuda"
    names = ["tiny"] if args.smoke else args.models.split(",")
    if args.smoke:
        args.rounds, args.steps = 2, 1
    out = {}
    for n in names:   # written after each model: a run cut short keeps what it measured
        ks = tuple(int(k) for k in args.accumulate.split(","))
        out[n] = run(n, args.rounds, args.steps, device, args.gradient_checkpointing, args.variants.split(","), ks)
        if not args.smoke:
            tag = ("-checkpointed" if args.gradient_checkpointing else "") + ("-" + n if n in ("gemma2", "gemma2_9b", "gemma2_9b_8k", "gemma2_9b_v256k", "gpt_oss", "bloom") else "") \
                + ("-fp8" if any("fp8" in v for v in args.variants.split(",")) else "") \
                + ("-accumulate" if max(ks) > 1 else "") + ("-amp" if args.recipe == "amp" else "") + (f"-{args.tag}" if args.tag else "")
            print("wrote", write("hf_default_attention" + tag, out), flush=True)


if __name__ == "__main__":
    main()
