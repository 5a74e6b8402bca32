"""AdamW step on the GPU: ``opsmath.optim.AdamW`` (clip inside; fp32, bf16 params with fp32 master
weights, 8-bit state) against torch's fused / foreach AdamW + ``clip_grad_norm_`` (and torchao's
``AdamW8bit`` where installed), on the parameter sets of GPT-2-small (163M, vocab 50304, lm_head untied)
and the 1.1B LLaMA of ``_models.llama_config``; with ``--train``, a whole GPT-2-small training step
(``torch.compile`` + SDPA, B8 T1024, bf16 autocast) with each optimizer.

Method (docs/design.md, Measuring): every variant lives at once and they run interleaved (A B C A B C
...) for ``--rounds`` rounds of ``--steps`` steps; the row gives the median ms per step and the spread
over rounds, the GPU kernel time per step (torch.profiler) and the host time to issue one step beside
it. State memory is what the optimizer's first step allocates and keeps. Floor = bytes a step must move / 4.13 TB/s (the H200's
measured copy bandwidth): fp32 with clip reads grads twice and reads+writes param, exp_avg, exp_avg_sq
(32 B/param); bf16 + master: 30; 8-bit state: 20 (fp32) and 18 (bf16 + master).

``--baseline FILE``: another AdamW class to time beside them (a file defining ``AdamW``, e.g. a
previous commit's ``src/opsmath/optim/__init__.py`` with its kernels), built with ``max_grad_norm=1.0``.

    python -m benchmarks optimizer [--sets gpt2,llama] [--train] [--rounds 7] [--steps 10]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from opsmath.optim import AdamW
from benchmarks._harness import kernel_ms, rel_err, timed_calls, write

COPY_TBPS = 4.13
V, C, L, T = 50304, 768, 12, 1024


def gpt2_small_shapes():
    shapes = [(V, C), (T, C)]
    for _ in range(L):
        shapes += [(C,), (C,), (C, 3 * C), (3 * C,), (C, C), (C,), (C,), (C,), (C, 4 * C), (4 * C,), (4 * C, C), (C,)]
    return shapes + [(C,), (C,), (V, C)]


def llama_shapes():
    from transformers import LlamaForCausalLM
    from benchmarks._models import llama_config
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config())
    return [tuple(p.shape) for p in model.parameters()]


def make(shapes, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).mul_(0.02).to(dtype)) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, device="cuda", generator=g).mul_(0.01).to(dtype)
    return ps


def optimizers(baseline: str | None) -> dict:
    """name -> (param dtype, optimizer factory, clip_grad_norm_ before the step, floor bytes/param)."""
    f32, bf16 = torch.float32, torch.bfloat16
    out = {
        "torch fused + clip_grad_norm_": (f32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), True, 32),
        "torch foreach + clip_grad_norm_": (f32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True), True, 32),
        "opsmath, clip inside": (f32, lambda ps: AdamW(ps, lr=1e-4, max_grad_norm=1.0), False, 32),
        "opsmath bf16 + fp32 master, clip inside": (
            bf16, lambda ps: AdamW(ps, lr=1e-4, max_grad_norm=1.0, master_weights=True), False, 30),
        "opsmath 8-bit state, clip inside": (
            f32, lambda ps: AdamW(ps, lr=1e-4, max_grad_norm=1.0, state_bits=8), False, 20),
        "opsmath bf16 + master + 8-bit state, clip inside": (
            bf16, lambda ps: AdamW(ps, lr=1e-4, max_grad_norm=1.0, master_weights=True, state_bits=8), False, 18),
        "torch fused (no clip)": (f32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), False, 28),
        "opsmath (no clip)": (f32, lambda ps: AdamW(ps, lr=1e-4), False, 28),
    }
    try:
        from torchao.optim import AdamW8bit
        out["torchao AdamW8bit + clip_grad_norm_"] = (f32, lambda ps: AdamW8bit(ps, lr=1e-4), True, 20)
    except Exception as e:  # not installed, or an API it does not have here
        print("torchao AdamW8bit not measured:", type(e).__name__, str(e)[:100])
    if baseline:
        spec = importlib.util.spec_from_file_location("baseline_adamw", baseline)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out["baseline (--baseline), clip inside"] = (f32, lambda ps: mod.AdamW(ps, lr=1e-4, max_grad_norm=1.0),
                                                     False, 32)
    return out


def host_ms(fn, calls: int = 10) -> float:
    """Host milliseconds to issue one ``fn()`` (the GPU drained first, so nothing waits on it)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / calls * 1e3


def param_set(set_name: str, shapes, args) -> list[dict]:
    n = sum(torch.Size(s).numel() for s in shapes)
    fns, meta = {}, {}
    for name, (dtype, make_opt, clip, floor_b) in optimizers(args.baseline).items():
        if set_name == "llama" and ("foreach" in name or "no clip" in name):
            continue   # the 1.1B set keeps to the rows the issue compares (memory: all live at once)
        ps = make(shapes, dtype)
        before = torch.cuda.memory_allocated()
        opt = make_opt(ps)

        def step(ps=ps, opt=opt, clip=clip):
            if clip:
                torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
            opt.step()
        step()
        torch.cuda.synchronize()
        fns[name] = step
        meta[name] = dict(dtype=str(dtype).replace("torch.", ""), floor_ms=n * floor_b / COPY_TBPS / 1e9,
                          state_gib=(torch.cuda.memory_allocated() - before) / 2**30)
    times = timed_calls(fns, args.rounds, args.steps)
    if args.host_profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                fns["opsmath, clip inside"]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    rows = []
    for name, ts in times.items():
        gpu = sum(kernel_ms(fns[name], calls=5).values())
        host = host_ms(fns[name])
        med = statistics.median(ts)
        rows.append(dict(set=set_name, impl=name, params=n, ms=med, ms_min=min(ts), ms_max=max(ts), gpu_ms=gpu,
                         host_ms=host, x_floor=med / meta[name]["floor_ms"], **meta[name]))
        print(f"{set_name:6} {name:50} {med:7.3f} ms [{min(ts):.3f}-{max(ts):.3f}]  gpu {gpu:7.3f}  host {host:6.3f}  "
              f"{med / meta[name]['floor_ms']:5.2f}x floor  state {meta[name]['state_gib']:6.2f} GiB")
    return rows


def numerics(shapes) -> dict:
    """Parameters after 3 steps, opsmath (clip inside; 8-bit state) vs torch fused + clip_grad_norm_."""
    out = {}
    for name, kw in (("opsmath", {}), ("opsmath 8-bit", dict(state_bits=8))):
        a, b = make(shapes, torch.float32), make(shapes, torch.float32)
        oa = AdamW(a, lr=1e-3, max_grad_norm=1.0, **kw)
        ob = torch.optim.AdamW(b, lr=1e-3, fused=True)
        for _ in range(3):
            oa.step()
            torch.nn.utils.clip_grad_norm_(b, 1.0)
            ob.step()
        out[name] = max(rel_err(x.detach(), y.detach()) for x, y in zip(a, b))
        print(f"max relative difference of parameters after 3 steps, {name} vs torch fused + clip: {out[name]:.2e}")
    return out


def train(args) -> list[dict]:
    """Whole GPT-2-small steps (compile + SDPA model, bf16 autocast), one model copy per optimizer."""
    from benchmarks._models import GPT2_SMALL, build
    variants = {"torch fused + clip_grad_norm_": (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True), True),
                "opsmath, clip inside": (lambda m: AdamW(m.parameters(), lr=1e-4, max_grad_norm=1.0), False),
                "opsmath 8-bit state, clip inside": (
                    lambda m: AdamW(m.parameters(), lr=1e-4, max_grad_norm=1.0, state_bits=8), False)}
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, GPT2_SMALL["vocab_size"], (8, 1024), device="cuda", generator=g)
    targets = torch.roll(idx, -1, 1)
    fns, resident, losses = {}, {}, {}
    for name, (make_opt, clip) in variants.items():
        before = torch.cuda.memory_allocated()
        model = torch.compile(build(GPT2_SMALL, "cuda", "sdpa"))
        opt = make_opt(model)

        def step(model=model, opt=opt, clip=clip):
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(idx, targets)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        losses[name] = [float(step()) for _ in range(3)]
        torch.cuda.synchronize()
        fns[name] = step
        resident[name] = (torch.cuda.memory_allocated() - before) / 2**30
    times = timed_calls(fns, args.rounds, args.steps)
    rows = []
    for name, ts in times.items():
        gpu = sum(kernel_ms(fns[name], calls=3).values())
        med = statistics.median(ts)
        rows.append(dict(set="gpt2 train step", impl=name, ms=med, ms_min=min(ts), ms_max=max(ts), gpu_ms=gpu,
                         resident_gib=resident[name], first_losses=losses[name]))
        print(f"train  {name:50} {med:7.3f} ms [{min(ts):.3f}-{max(ts):.3f}]  gpu {gpu:7.3f}  "
              f"resident {resident[name]:6.2f} GiB  losses {[round(x, 4) for x in losses[name]]}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", default="gpt2,llama")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--host-profile", action="store_true", help="torch.profiler CPU table of opsmath's step")
    args = ap.parse_args()
    rows, sets = [], {"gpt2": gpt2_small_shapes, "llama": llama_shapes}
    for s in args.sets.split(","):
        if s:
            rows += param_set(s, sets[s](), args)
            torch.cuda.empty_cache()
    err = numerics(gpt2_small_shapes())
    torch.cuda.empty_cache()
    if args.train:
        rows += train(args)
    path = write("optimizer", dict(rows=rows, numerics_max_rel_err=err, rounds=args.rounds, steps=args.steps))
    print("wrote", path)


if __name__ == "__main__":
    main()
