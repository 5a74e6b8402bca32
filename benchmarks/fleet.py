"""A fleet of Hugging Face architectures, each trained for a few steps under ``torch.compile`` and under
``opsmath.optimize``, interleaved in one process: where opsmath gains, where it loses, what it rewrote.

Twelve architectures at 0.1-0.4B parameters (``--width 2``: widths and head counts doubled, 0.4-0.9B), built
from their config classes as they load by default (no ``attn_implementation``: SDPA, Gemma-2's eager), dropout
off, ``use_cache=False`` where the call takes it: LLaMA, Mistral (sliding window 512 at T1024), Qwen2, Gemma-2,
Phi-3, GPT-NeoX, GPT-2 (causal LM, B4 T1024), BERT (masked LM, B16 T512, odd rows padded), ViT (image
classification, B32 224x224), T5 (B8, 512 tokens in, 128 out), Mixtral (8 experts top-2) and Qwen2-MoE (16
experts top-4 and a shared expert).

Two recipes (``--recipes``), torch fused AdamW in both: ``amp``, fp32 weights, the forward under bf16 autocast
and the backward outside it (HF Trainer's ``bf16=True``); ``bf16``, weights cast to bf16, no autocast.

Per model, recipe and variant, after two warm-up steps (capture, compile, tuning), ``--rounds`` rounds of
``--steps`` timed steps, A B A B: median and spread (min-max) of the per-round median step time, GPU kernel
time per step (torch.profiler), the step's peak memory above what is resident before it, the first
step's wall time (capture and compile included) and loss; for opsmath its rewrites, declines, fallback
errors and graphs; and the ratio of each variant's step time and peak to the baseline's (torch.compile).
A failing model or variant is an error row; the JSON is written after every model and recipe. At the end,
per recipe: the geometric mean of baseline / variant step time, and the rows whose peak is off by over 2%.

    python -m benchmarks fleet [--models llama,bert] [--recipes amp,bf16] [--rounds 5] [--steps 3]
        [--variants torch.compile,opsmath.optimize] [--tag NAME] [--host] [--width 2]
    python -m benchmarks fleet --smoke [--models gpt2,bert]   # tiny models on CPU: runs, measures nothing
    python -m benchmarks fleet --table results/fleet-A.json results/fleet-B.json   # BENCHMARKS.md's table

``--smoke`` compares eager with opsmath (torch.compile's C++ compiles are slow on a CPU) unless ``--variants``
says otherwise (``skip=FAMILY``: opsmath without one family), writing to a temporary folder unless ``$OUT`` is set.
"""
from __future__ import annotations

import argparse
import functools
import gc
import inspect
import math
import os
import time
from unittest import mock

import torch

import opsmath
from opsmath.kernels import autotune
from benchmarks._fleet_models import ALL, MODELS, config
from benchmarks._harness import host_breakdown, idle_line, interleave, out_path, smoke_out, write
from benchmarks.hf_default_attention import Variant

RECIPES = ("amp", "bf16")
# variants that capture and run with an environment variable set: "(priced)" (rewrite/price.py: the families Inductor
# may fuse as well, kept where they measure faster); "(bf16 wgrad)": weight gradients rounded as eager's
# (runtime/wgrad.py); "(fp32 experts mm)", "(fp32 experts split)", "(fp32 experts tf32x3)": fp32 grouped GEMMs as
# cuBLAS's per-group mm, with the token operand split ahead, or Triton's tf32x3 (kernels/grouped_mm.py);
# "skip=F": without the family F
ENV = {"opsmath.optimize(priced)": {"OPSMATH_PRICE": "1"}, "opsmath.optimize(bf16 wgrad)": {"OPSMATH_FP32_WGRAD": "0"},
       **{f"opsmath.optimize(fp32 experts {p})": {"OPSMATH_FP32_GROUPED_GEMM": p} for p in ("mm", "split", "tf32x3")}}
VARIANTS = {"torch.compile": torch.compile, "opsmath.optimize": opsmath.optimize, "eager": lambda m: m,
            "opsmath.optimize(cuda_graphs)": functools.partial(opsmath.optimize, cuda_graphs=True),
            **dict.fromkeys(ENV, opsmath.optimize), **{f"skip={f}": functools.partial(opsmath.optimize, skip=[f])
                                                         for f in opsmath.patterns.NAMES}}
PEAK_BAND = (0.98, 1.02)   # the summary lists rows whose peak is off the baseline's by more than this
FIRST_BOUND = 1.5          # ... and those whose first step takes more than this times the baseline's


def build(name: str, recipe: str, device: str, smoke: bool, width: int = 1) -> torch.nn.Module:
    import transformers
    cls, cfg_cls, *_ = ALL[name]
    torch.manual_seed(0)
    if cls.startswith("timm:"):
        import timm
        model = TimmLoss(timm.create_model(cls[5:], pretrained=False, **config(name, smoke)))
    else:   # default attention
        model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**config(name, smoke, width)))
    dtype = torch.bfloat16 if recipe == "bf16" else torch.float32
    return model.to(device=device, dtype=dtype).train()


def inputs(name: str, model: torch.nn.Module, device: str, smoke: bool) -> tuple[dict, str]:
    """One fixed batch for ``name`` (the same for every variant) and its shape in words."""
    _, _, _, _, kind, shape, tiny_shape = ALL[name]
    cfg, shape, g = config(name, smoke), tiny_shape if smoke else shape, torch.Generator().manual_seed(0)
    B, T = shape["B"], shape.get("T")
    if kind in ("image", "timm_image"):
        size, dtype = cfg.get("image_size", cfg.get("img_size", 224)), next(model.parameters()).dtype
        batch = dict(pixel_values=torch.randn(B, 3, size, size, generator=g).to(dtype),
                     labels=torch.randint(0, cfg.get("num_labels", cfg.get("num_classes")), (B,), generator=g))
        words = f"B{B} 3x{size}x{size}"
    else:
        ids = torch.randint(1, cfg["vocab_size"], (B, T), generator=g)
        batch, words = dict(input_ids=ids, labels=ids), f"B{B} T{T}"
    if kind == "mlm":   # odd rows padded (pad id 0) to between half and three quarters of T
        lengths = torch.tensor([T if i % 2 == 0 else T // 2 + i * T // (4 * B) for i in range(B)])
        mask = (torch.arange(T)[None] < lengths[:, None]).long()
        batch = dict(input_ids=ids * mask, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        words += f" ({B // 2} rows padded)"
    if kind == "seq2seq":
        batch["labels"] = torch.randint(1, cfg["vocab_size"], (B, shape["labels"]), generator=g)
        words += f" in, T{shape['labels']} out"
    batch = {k: v.to(device) for k, v in batch.items()}
    if "use_cache" in inspect.signature(model.forward).parameters:
        batch["use_cache"] = False
    return batch, words


class TimmLoss(torch.nn.Module):
    """A timm classifier and the loss a training loop takes on its logits (the step's loss: a tensor output)."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, pixel_values, labels):
        return torch.nn.functional.cross_entropy(self.net(pixel_values), labels)


class FleetVariant(Variant):
    """hf_default_attention's variant (warm-up, timed rounds, row) with a recipe: ``amp`` runs the forward
    under bf16 autocast, the backward and the optimizer outside it."""

    def __init__(self, label, model, batch, device, recipe):
        super().__init__(label, model, batch, device)
        self.recipe, self.amp = recipe, recipe == "amp"   # the recipe is this row's, not the module's default
        self.phases, self._start = {}, time.perf_counter()   # the first step's forward, backward, optimizer

    def step(self, accumulate: int = 1):
        if self.label not in ENV:   # patching os.environ rewrites the whole environment: not in every row's step
            return self._step()
        with mock.patch.dict(os.environ, ENV[self.label]):
            return self._step()

    def _step(self):
        lap = self._lap if "optimizer_s" not in self.phases else (lambda name: None)   # the first step's parts
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.recipe == "amp"):
            out = self.model(**self.batch)
            loss = out if isinstance(out, torch.Tensor) else out.loss
        lap("forward_s")
        loss.backward()
        lap("backward_s")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        lap("optimizer_s")
        return loss

    def _lap(self, name: str) -> None:
        """Seconds since the last lap (the first: since the step began), the device waited for."""
        self.sync()
        now = time.perf_counter()
        self.phases[name], self._mark = round(now - getattr(self, "_mark", self._start), 2), now

    def warm_up(self):
        """The harness's warm-up; for opsmath also where its first step went (``first_parts``)."""
        tuned = dict(autotune.SPENT)
        self._start = time.perf_counter()
        with mock.patch.dict(os.environ, ENV.get(self.label, {})):
            super().warm_up()
        if hasattr(self.model, "_opsmath"):
            graphs = opsmath.report(self.model).graphs
            self.first_parts = dict(
                tuning_s=autotune.SPENT["seconds"] - tuned["seconds"], tuned=autotune.SPENT["tuned"] - tuned["tuned"],
                tuning_first_calls_s=autotune.SPENT["first_calls"] - tuned["first_calls"],
                capture_s=sum(g.capture_seconds for g in graphs), inductor_s=sum(g.inductor_seconds for g in graphs))

    def row(self, accumulate: int = 1, tagged: bool = False):
        r = super().row()
        r.pop("accumulate"), r.pop("recipe", None)
        r = dict(variant=r.pop("name"), recipe=self.recipe, first_phases=self.phases, **r)
        if hasattr(self.model, "_opsmath"):
            rep = opsmath.report(self.model)
            r["declines"] = len(rep.declines)
            r["priced"] = [f"{m.pattern}@{m.anchor} kept: {m.details['priced']}" for m in rep.matches
                           if "priced" in m.details] + [f"{d.pattern}@{d.node} declined: {d.reason}"
                                                        for d in rep.declines if "Inductor" in d.reason]
            r["first_parts"] = self.first_parts   # capture_s includes tuning and Inductor (inductor_s)
        return r


def run(name, recipe, labels, rounds, steps, device, smoke, host=False, width=1) -> list[dict]:
    """The rows of one model under one recipe: every variant built from one seed, warmed up, then timed
    in interleaved rounds. A variant that fails to build or warm up is an error row. ``host``: each row
    also gets where its step's host time goes (``_harness.host_breakdown``)."""
    torch._dynamo.reset()
    with torch.device("meta"):   # the parameter count and the inputs' dtype, nothing allocated
        probe = build(name, recipe, "meta", smoke, width)
    batch, shape = inputs(name, probe, device, smoke)
    info = dict(model=name, shape=shape, params=sum(p.numel() for p in probe.parameters()))
    print(f"{name} {recipe}: {info['params'] / 1e6:.1f}M parameters, {shape}", flush=True)
    del probe
    variants, errors = [], []
    for label in labels:
        try:
            v = FleetVariant(label, VARIANTS[label](build(name, recipe, device, smoke, width)), batch, device, recipe)
            v.warm_up()
        except Exception as e:  # noqa: BLE001
            v = None   # its model, grads and optimizer state freed before the next variant builds
            errors.append(dict(info, recipe=recipe, variant=label, error=f"{type(e).__name__}: {e}"[:2000]))
            print(f"{name} {recipe} {label}: failed: {errors[-1]['error'][:300]}", flush=True)
            continue
        variants.append(v)
        print(f"{name} {recipe} {label}: first step {v.first_s:.1f} s, loss {v.first_loss:.4f}", flush=True)
    interleave(variants, rounds, steps)
    rows = [dict(info, **v.row()) for v in variants]
    base = next((r for r in rows if r["variant"] == "torch.compile"), rows[0] if rows else None)
    for r in rows:
        r["baseline"], r["ms_ratio"] = base["variant"], r["ms"] / base["ms"]
        r["first_ratio"] = r["first_step_s"] / max(base["first_step_s"], 1e-9)
        if host:
            v = next(v for v in variants if v.label == r["variant"])
            r["host"] = host_breakdown(v.step, trace=out_path(
                f"trace-{name}-{recipe}-{r['variant'].replace(' ', '_')}.json.gz"))
            print(host_line(r), flush=True)
        if "step_peak_gib" in r:
            r["peak_ratio"] = r["step_peak_gib"] / max(base["step_peak_gib"], 1e-9)
        print(line(r), flush=True)
        for p in r.get("priced", []):
            print(f"    priced {p[:220]}", flush=True)
    return rows + errors


def line(r: dict) -> str:
    head = f"{r['model']:10} {r['recipe']:4} {r['variant'] or '-':16}"
    if "error" in r:
        return f"{head} ERROR {r['error'][:300]}"
    out = (f"{head} {r['ms']:8.2f} ms [{r['ms_min']:.2f}-{r['ms_max']:.2f}] gpu {r.get('gpu_ms', 0):8.2f} ms "
           f"peak {r.get('step_peak_gib', 0):6.2f} GiB first {r['first_step_s']:6.1f} s loss {r['first_loss']:.4f} "
           f"ms x{r['ms_ratio']:.3f} peak x{r.get('peak_ratio', float('nan')):.3f} first x{r['first_ratio']:.2f}"
           f" vs {r['baseline']}" + ("; first step " + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in r["first_phases"].items())
                                      if r.get("first_phases") else ""))
    if "rewrites" in r:
        p = r["first_parts"]
        out += (f" {r['rewrites']} declines {r['declines']} graphs {r['graphs']}"
                f" fallbacks {len(r['fallbacks'])}; first step: capture {p['capture_s']:.1f} s (tuning"
                f" {p['tuning_s']:.1f} s, {p['tuned']} choices, {p.get('tuning_first_calls_s', 0):.1f} s of it first"
                f" calls; Inductor {p['inductor_s']:.1f} s)")
    return out


def host_line(r: dict) -> str:
    h = r["host"]
    ops = ", ".join(f"{o['name']} {o['self_cpu_ms']:.2f}" for o in h["ops"][:8])
    py = ", ".join(f"{o['name']} {o['own_ms']:.2f}" for o in h["python"][:8])
    return (f"  host {r['variant']}: {h['wall_ms_profiled']:.2f} ms/step under cProfile, {h['launches']:.0f} "
            f"launches, {h['syncs']:.0f} syncs, {h['python_calls']:.0f} Python calls\n    ops (self CPU ms): {ops}"
            f"\n    Python (own ms): {py}\n    GPU idle: {idle_line(h['gpu_idle'])}" + "".join(f"\n    sync x{s['count']} {s['event']} at "
                                                  + " <- ".join(s['stack'][:4]) for s in h.get("sync_sites", [])))


def summary(rows: list[dict], recipes) -> dict:
    """Per recipe and variant (other than the baseline): the geometric mean over models of baseline /
    variant step time, the rows whose peak is outside ``PEAK_BAND`` of the baseline's, and the largest
    first step against the baseline's (``FIRST_BOUND``: issue's bound) with the rows above it."""
    out = {}
    for recipe in recipes:
        timed = [r for r in rows if r["recipe"] == recipe and "error" not in r and r["variant"] != r["baseline"]]
        for variant in dict.fromkeys(r["variant"] for r in timed):
            mine = [r for r in timed if r["variant"] == variant]
            gmean = math.exp(sum(-math.log(r["ms_ratio"]) for r in mine) / len(mine))
            off = {r["model"]: round(r["peak_ratio"], 3) for r in mine
                   if "peak_ratio" in r and not PEAK_BAND[0] <= r["peak_ratio"] <= PEAK_BAND[1]}
            slow = {r["model"]: round(r["first_ratio"], 2) for r in mine if r["first_ratio"] > FIRST_BOUND}
            out[f"{recipe} {variant}"] = dict(speedup_gmean=gmean, models=len(mine), peak_off=off,
                                              first_max=max(r["first_ratio"] for r in mine), first_off=slow,
                                              baseline=mine[0]["baseline"])
    errors = [f"{r['model']} {r['recipe']} {r.get('variant') or ''}".strip() for r in rows if "error" in r]
    for key, s in out.items():
        print(f"{key}: {s['baseline']} / it, geometric mean over {s['models']} models: x{s['speedup_gmean']:.3f}; "
              f"peak outside {PEAK_BAND[0]}-{PEAK_BAND[1]}x: {s['peak_off'] or 'none'}; first step at most"
              f" x{s['first_max']:.2f}, above {FIRST_BOUND}x: {s['first_off'] or 'none'}", flush=True)
    print(f"errors: {errors or 'none'}", flush=True)
    return dict(recipes=out, errors=errors)


def table(paths: list[str]) -> None:
    """The rows of fleet JSON files (``paths``, e.g. two calls of one run) as BENCHMARKS.md's table, one per
    recipe and variant against its baseline, then ``summary`` over them all."""
    import json
    rows = [r for p in paths for r in json.load(open(p))["rows"]]
    cell = lambda r: (f"{r['ms']:.2f} [{r['ms_min']:.2f}-{r['ms_max']:.2f}] | {r.get('gpu_ms', 0):.2f} | "   # noqa: E731
                      f"{r.get('step_peak_gib', 0):.2f} | {r['first_step_s']:.1f}")
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    for recipe in recipes:
        base = {r["model"]: r for r in rows if r["recipe"] == recipe and "error" not in r and r["variant"] == r["baseline"]}
        for variant in dict.fromkeys(r["variant"] for r in rows if r["recipe"] == recipe and r["model"] in base
                                     and "error" not in r and r["variant"] != r["baseline"]):
            print(f"\n**{recipe}**, {variant} against its baseline\n| model (shape) | params | baseline ms [spread] | GPU ms | "
                  "peak GiB | first s | ms [spread] | GPU ms | peak GiB | first s | wall | peak | first | GPU |\n"
                  + "|---" * 14 + "|")
            for r in rows:
                b = base.get(r["model"])
                if r["recipe"] != recipe or r["variant"] != variant or "error" in r or b is None:
                    continue
                gpu = b.get("gpu_ms", 0) / r["gpu_ms"] if r.get("gpu_ms") else float("nan")
                print(f"| {r['model']} ({r['shape']}) | {r['params'] / 1e9:.2f}B | {cell(b)} | {cell(r)} | "
                      f"{1 / r['ms_ratio']:.3f}x | {r.get('peak_ratio', float('nan')):.3f}x | {r['first_ratio']:.2f}x | "
                      f"{gpu:.3f}x |")
    summary(rows, recipes)


def free(device: str):
    gc.collect()
    torch.cuda.empty_cache() if device == "cuda" else None
    torch._dynamo.reset()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS), help=",".join(ALL))
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--variants", default=None, help=f"of {','.join(VARIANTS)}; the first is the baseline unless "
                    "torch.compile is there (default: torch.compile,opsmath.optimize; --smoke: eager,opsmath.optimize)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tag", default="")
    ap.add_argument("--deadline-s", type=float, default=0,
                    help="start no model/recipe after this many seconds (an error row each): the summary still prints")
    ap.add_argument("--host", action="store_true", help="also profile where each row's host time goes")
    ap.add_argument("--smoke", action="store_true", help="tiny models on CPU: checks the script, measures nothing")
    ap.add_argument("--width", type=int, default=1, help="widths and head counts times this (2: 0.4-0.9B)")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print these results as a table; run nothing")
    args = ap.parse_args()
    if args.table:
        return table(args.table)
    models, recipes = args.models.split(","), args.recipes.split(",")
    labels = (args.variants or ("eager," if args.smoke else "torch.compile,") + "opsmath.optimize").split(",")
    bad = sorted(set(models) - set(ALL)) + sorted(set(recipes) - set(RECIPES)) + sorted(set(labels) - set(VARIANTS))
    if bad:
        ap.error(f"unknown models, recipes or variants {bad}")
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.rounds, args.steps = 1, 1
        smoke_out("fleet")
    name = "fleet-" + (args.tag or ("all" if models == list(MODELS) else "-".join(models))) \
        + ("" if set(recipes) == set(RECIPES) else "-" + "-".join(recipes)) + ("-smoke" if args.smoke else "") \
        + (f"-width{args.width}" if args.width != 1 else "")
    rows, payload, start = [], dict(args=vars(args), variants=labels, configs={}), time.monotonic()
    for model in models:
        for recipe in recipes:
            if args.deadline_s and time.monotonic() - start > args.deadline_s:
                rows.append(dict(model=model, recipe=recipe, variant=None, error="not run: past --deadline-s"))
                print(line(rows[-1]), flush=True)
                continue
            try:
                payload["configs"][model] = config(model, args.smoke, args.width)
                rows += run(model, recipe, labels, args.rounds, args.steps, device, args.smoke, args.host, args.width)
            except Exception as e:  # noqa: BLE001
                rows.append(dict(model=model, recipe=recipe, variant=None, error=f"{type(e).__name__}: {e}"[:2000]))
                print(line(rows[-1]), flush=True)
            free(device)
            write(name, dict(payload, rows=rows))   # after each: a run cut short keeps what it measured
    payload["summary"] = summary(rows, recipes)
    print("wrote", write(name, dict(payload, rows=rows)), flush=True)


if __name__ == "__main__":
    main()
