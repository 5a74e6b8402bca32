"""Mixture-of-experts training steps: ``torch.compile`` vs ``opsmath.optimize``, interleaved in one process.

Models (torch fused AdamW, B4 T2048 unless ``--batch``/``--seq``; ``--recipe amp``, the default: fp32 weights
under bf16 autocast, ``--recipe bf16``: bf16 weights):
- ``mixtral``: Hugging Face Mixtral-style (hidden 1024, 8 layers, GQA 16/8, 8 experts top-2, MLP 2816) as
  it loads by default (SDPA attention, the ``grouped_mm`` experts implementation);
- ``mixtral-eager-experts``: the same with ``experts_implementation="eager"`` (a loop over hit experts);
- ``qwen2_moe``: Qwen2-MoE-style, 64 experts top-8 (MLP 704) plus a gated shared expert (2816);
- ``loop``/``loop64``: ``opsmath.examples.Mixtral`` at the same sizes, the Mistral reference's routing
  loop over ``nn.ModuleList`` experts with ``torch.where`` (8 top-2; 64 top-8 with MLP 704);
- ``loop-imbalanced``: ``loop`` with a router bias that puts expert 0 in every token's top-2 (half of
  all routed slots on one expert); ``mixtral-imbalanced``, ``qwen2_moe-imbalanced``: the HF models with
  that bias in each router (``BiasedRouter``: expert 0 in every token's top-k, half of Mixtral's slots,
  an eighth of Qwen2-MoE's top-8).

Per variant: median and spread of per-round median step times (``--rounds`` rounds of ``--steps``), GPU
kernel time per step, the step's peak memory above what is resident, and for opsmath what it rewrote.

    python -m benchmarks moe [--models loop,mixtral] [--rounds 5] [--steps 3] [--variants ...] [--smoke]
    python -m benchmarks moe --cpu --layers 8 --models loop64 --batch 2 --seq 64 \
        --variants "torch.compile,opsmath.optimize,opsmath.optimize(one graph)"   # first steps: tracing

``opsmath.optimize(one graph)``: every expert loop traced in the model's one graph, as before
``patterns/experts/regional.py`` (which traces a repeated loop once for all its modules).
``opsmath.optimize(gather)`` / ``(no gather)`` / ``(gather auto)``: the experts' first GEMMs reading the token
rows through the routing index (``opsmath::grouped_mm_gather``), gathering them first (the default), or
whichever measures faster per shape.
    python -m benchmarks moe --curve 200 --models loop --batch 2 --seq 1024 [--curve-fp8 [every]]   # loss curves vs eager
"""
from __future__ import annotations

import argparse
import contextlib
import os
from collections import Counter
from unittest import mock

import torch

import opsmath
import opsmath.patterns.experts.regional as regional
from opsmath import examples
from benchmarks._harness import interleave, write
from benchmarks.hf_default_attention import RECIPE, Variant

HF = {  # name: (transformers class, config class, config kwargs)
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=2816, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=4096)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=2816, moe_intermediate_size=704, shared_expert_intermediate_size=2816,
        num_experts=64, num_experts_per_tok=8, vocab_size=32000, max_position_embeddings=4096)),
}
HF_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
               moe_intermediate_size=32, shared_expert_intermediate_size=64, vocab_size=256)   # --smoke
LOOP = {"loop": dict(n_expert=8, top_k=2, hidden=2816), "loop64": dict(n_expert=64, top_k=8, hidden=704)}
TINY = dict(dim=64, n_layer=2, n_head=4, n_kv_head=2, vocab_size=256)
LAYERS = [0]    # --layers: the loop models' layer count where given
SIZE = dict(dim=1024, n_layer=8, n_head=16, n_kv_head=8, vocab_size=32000)


def build(name: str, device: str, seq: int, seed: int = 0):
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" and RECIPE[0] == "bf16" else torch.float32
    base = name.replace("-eager-experts", "").replace("-imbalanced", "")
    if base in HF:
        import transformers
        cls, cfg_cls, cfg = HF[base]
        extra = dict(experts_implementation="eager") if name.endswith("eager-experts") else {}
        cfg = dict(cfg, **HF_TINY) if device == "cpu" else cfg
        model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**cfg, **extra))
        if name.endswith("imbalanced"):
            for layer in model.model.layers:
                layer.mlp.gate = BiasedRouter(layer.mlp.gate)
        batch = lambda ids: dict(input_ids=ids, labels=ids, use_cache=False)   # noqa: E731
    else:
        size = dict(TINY if device == "cpu" else SIZE, **({"n_layer": LAYERS[0]} if LAYERS[0] else {}))
        model = examples.Mixtral(max_len=seq, **size, **LOOP[base])
        if name.endswith("imbalanced"):
            for layer in model.layers:
                gate = layer.moe.gate
                layer.moe.gate = torch.nn.Linear(gate.in_features, gate.out_features)
                with torch.no_grad():
                    layer.moe.gate.weight.copy_(gate.weight)
                    layer.moe.gate.bias.zero_()[0] = 10.0
        batch = lambda ids: (ids, torch.roll(ids, -1, dims=1))                   # noqa: E731
    return model.to(device=device, dtype=dtype).train(), batch


class BiasedRouter(torch.nn.Module):
    """An HF top-k router (Mixtral's, Qwen2-MoE's: ``weight`` [E, hidden]) with a bias of 10 on expert 0's
    logit, which puts expert 0 in every token's top-k: the router's own softmax, top-k and
    renormalization (where the router has it on) after it."""

    def __init__(self, router: torch.nn.Module):
        super().__init__()
        self.weight, self.top_k = router.weight, router.top_k
        self.norm = getattr(router, "norm_topk_prob", True)
        self.register_buffer("bias", torch.zeros(router.weight.shape[0]).index_fill_(0, torch.tensor(0), 10.0))

    def forward(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.weight.shape[1]), self.weight)
        logits = logits + self.bias.to(logits.dtype)
        top, idx = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        if self.norm:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx


class MoEVariant(Variant):
    def step(self, accumulate: int = 1):
        for _ in range(accumulate):
            with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.amp):
                out = self.model(**self.batch) if isinstance(self.batch, dict) else self.model(*self.batch)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


def _one_graph(model):
    """``opsmath.optimize`` with every expert loop traced in the model's one graph (``regional.py`` off)."""
    keep, regional.REGIONAL_EXPERTS = regional.REGIONAL_EXPERTS, 10**9
    try:
        return opsmath.optimize(model)
    finally:
        regional.REGIONAL_EXPERTS = keep


VARIANTS = {"torch.compile": torch.compile, "opsmath.optimize": opsmath.optimize, "eager": lambda m: m,
            "opsmath.optimize(fp8=True)": lambda m: opsmath.optimize(m, fp8=True),
            "opsmath.optimize(one graph)": _one_graph, "opsmath.optimize(gather)": opsmath.optimize,
            "opsmath.optimize(no gather)": opsmath.optimize, "opsmath.optimize(gather auto)": opsmath.optimize,
            "opsmath.optimize(masks kept)": opsmath.optimize}
# set while the variant captures: the experts' first GEMMs reading the token rows through the routing index
# (``kernels/grouped_gather.py``), forced on or off instead of measured
CAPTURE_ENV = {"opsmath.optimize(gather)": {"OPSMATH_GATHER_GEMM": "1"},
               "opsmath.optimize(no gather)": {"OPSMATH_GATHER_GEMM": "0"},
               "opsmath.optimize(gather auto)": {"OPSMATH_GATHER_GEMM": "auto"}}
# patched while the variant captures: ``masks kept`` leaves the fills under impossible masks
# (``rewrite/normalize.impossible_masks``: transformers 5.17's expert-parallel sentinels) in the graph
CAPTURE_PATCH = {"opsmath.optimize(masks kept)": ("opsmath.rewrite.match.impossible_masks", lambda graph: 0)}


def run(name, rounds, steps, device, labels, B, T):
    vocab = (TINY if device == "cpu" else SIZE)["vocab_size"]   # (HF_TINY's too)
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (B, T), device=device)
    torch._dynamo.reset()
    variants = []
    for label in labels:
        model, batch = build(name, device, T)
        variants.append(MoEVariant(label, VARIANTS[label](model), batch(ids), device))
    for v in variants:
        patch = mock.patch(*CAPTURE_PATCH[v.label]) if v.label in CAPTURE_PATCH else contextlib.nullcontext()
        with mock.patch.dict(os.environ, CAPTURE_ENV.get(v.label, {})), patch:
            v.warm_up()
        print(f"{name} {v.label}: first step {v.first_s:.1f} s, loss {v.first_loss:.4f}", flush=True)
    interleave(variants, rounds, steps)
    rows = [v.row() for v in variants]
    for r in rows:
        r["speedup_vs_first"] = rows[0]["ms"] / r["ms"]
        print(f"{name:22} {r['name']:18} {r['ms']:8.2f} ms [{r['ms_min']:.2f}-{r['ms_max']:.2f}] "
              f"gpu {r.get('gpu_ms', 0):8.2f} ms peak {r.get('step_peak_gib', 0):6.2f} GiB "
              f"x{r['speedup_vs_first']:.3f} {r.get('rewrites', '')} graphs {r.get('graphs', '')} "
              f"{r.get('fallbacks', '')}", flush=True)
    return dict(batch=[B, T], rows=rows)


@contextlib.contextmanager
def fp8_every_gemm():
    """FP8 wherever the FP8 families can take a GEMM, paying or not (a numerics test): the size thresholds of
    ``patterns.fp8_linear`` and ``patterns.fp8_experts`` lowered while the model is captured, restored after."""
    from opsmath.patterns import fp8_experts as experts, fp8_linear as linear
    kept = linear.MIN_DIM, linear.SHARED_MIN_DIM, experts.MIN_HARMONIC, experts.MIN_ROWS_PER_EXPERT
    linear.MIN_DIM = linear.SHARED_MIN_DIM = 16
    experts.MIN_HARMONIC = experts.MIN_ROWS_PER_EXPERT = 0
    try:
        yield
    finally:
        linear.MIN_DIM, linear.SHARED_MIN_DIM, experts.MIN_HARMONIC, experts.MIN_ROWS_PER_EXPERT = kept


def curve(name, steps, device, B, T, lr=3e-4, fp8="", save=None):
    """Loss per step of eager and opsmath (``fp8``: also opsmath with FP8 GEMMs, ``"every"``: in every GEMM
    the FP8 families can take, ``fp8_every_gemm``) from one initialization on one data stream (four fixed
    batches, cycled, so that the loss falls), and of eager from another initialization (``eager, seed 1``):
    the run-to-run noise the opsmath curves are judged against. ``save(partial)``, where given, is called with
    the curves so far after each run (a run cut short keeps the ones that ended)."""
    vocab = (TINY if device == "cpu" else SIZE)["vocab_size"]
    curves, info = {}, {}
    runs = [("eager", 0, None), ("opsmath.optimize", 0, opsmath.optimize), ("eager, seed 1", 1, None)]
    if fp8:
        label = "opsmath.optimize(fp8=True" + (", every GEMM)" if fp8 == "every" else ")")
        runs.insert(2, (label, 0, VARIANTS["opsmath.optimize(fp8=True)"]))
    for label, seed, wrap in runs:
        with fp8_every_gemm() if "every GEMM" in label else contextlib.nullcontext():
            curves[label], info[label] = _losses(name, seed, wrap, steps, device, B, T, vocab, lr)
        if save is not None:
            save(dict(batch=[B, T], lr=lr, curves=curves, rewrites=info, partial=True))
        print(f"{name} {label}: loss {curves[label][0]:.4f} -> {curves[label][-1]:.4f} {info[label]}", flush=True)
    gaps = {k: max(abs(a - b) for a, b in zip(curves["eager"], c)) for k, c in curves.items() if k != "eager"}
    tail = lambda c: sum(c[-20:]) / len(c[-20:])   # noqa: E731
    print(f"{name}: max |curve - eager| " + ", ".join(f"{k} {g:.4f}" for k, g in gaps.items()) + "; last-20 means "
          + ", ".join(f"{k} {tail(v):.4f}" for k, v in curves.items()), flush=True)
    return dict(batch=[B, T], lr=lr, curves=curves, max_gap=gaps["opsmath.optimize"], max_seed_gap=gaps["eager, seed 1"],
                max_gaps=gaps, rewrites=info)


def _losses(name, seed, wrap, steps, device, B, T, vocab, lr):
    """The losses of ``steps`` steps of ``build(name)`` from ``seed`` (wrapped by ``wrap`` where given) on four
    fixed batches, cycled, and the rewrites opsmath made (pattern: count; FP8 experts by kind)."""
    torch._dynamo.reset()
    model, batch = build(name, device, T, seed=seed)
    model = wrap(model) if wrap else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device == "cuda")
    data = torch.Generator(device="cpu").manual_seed(1234)   # 4 batches, cycled: a loss that falls
    stream = [torch.randint(0, vocab, (B, T), generator=data).to(device) for _ in range(4)]
    losses = []
    for step in range(steps):
        inputs = batch(stream[step % len(stream)])
        with torch.autocast(device, dtype=torch.bfloat16, enabled=RECIPE[0] == "amp"):
            out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    matches = opsmath.report(model).matches if wrap is not None else []
    return losses, dict(Counter(m.pattern + (f" {m.details.get('dtype')}" if m.pattern == "fp8_experts" else "")
                                for m in matches))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="loop,loop64,loop-imbalanced,mixtral,qwen2_moe")
    ap.add_argument("--variants", default="torch.compile,opsmath.optimize")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--tag", default="")
    ap.add_argument("--curve", type=int, default=0, help="loss curves of this many steps instead of timing")
    ap.add_argument("--curve-fp8", nargs="?", const="rule", default="", choices=["rule", "every"],
                    help="the curves include opsmath.optimize(fp8=True): FP8 where the per-layer rules take it, "
                         "or ('every') in every GEMM the FP8 families can take (a numerics test)")
    ap.add_argument("--recipe", choices=["amp", "bf16"], default="amp",
                    help="amp: fp32 weights under bf16 autocast (what most users run); bf16: bf16 weights")
    ap.add_argument("--smoke", action="store_true", help="tiny models on CPU: checks the script, measures nothing")
    ap.add_argument("--cpu", action="store_true", help="tiny widths on the CPU (first steps: tracing costs)")
    ap.add_argument("--layers", type=int, default=0, help="layers of the loop models (default: 8, 2 on CPU)")
    args = ap.parse_args()
    RECIPE[0], LAYERS[0] = args.recipe, args.layers
    device = "cpu" if args.smoke or args.cpu else "cuda"
    if args.smoke:
        args.rounds, args.steps, args.batch, args.seq = 2, 1, 2, 32
        args.models = "loop,loop-imbalanced,mixtral-imbalanced"
    out = {}
    name = "moe" + ("-curve" if args.curve else "") + ("-cpu" if args.cpu else "") + f"-{args.recipe}" + args.tag
    for n in args.models.split(","):   # written after each model (and each curve): a run cut short keeps its part
        if args.curve:
            save = None if args.smoke else (lambda part, n=n: write(name, dict(out, **{n: part})))
            out[n] = curve(n, args.curve, device, args.batch, args.seq, fp8=args.curve_fp8, save=save)
        else:
            out[n] = run(n, args.rounds, args.steps, device, args.variants.split(","), args.batch, args.seq)
        if not args.smoke:
            print("wrote", write(name, out), flush=True)


if __name__ == "__main__":
    main()
