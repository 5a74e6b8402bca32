"""HF ``Trainer`` as users run it: ``opsmath.optimize(model)`` handed to the Trainer, against the same
Trainer with ``torch_compile=True``; HF LLaMA 1.1B (``_models.llama_config``, default SDPA attention),
``bf16=True`` (fp32 weights under bf16 autocast), the Trainer's default optimizer and clipping (max norm 1).

Both models live at once (same seed, same data) and train interleaved: each round calls ``train()`` on
one Trainer, then the other, for ``--steps`` optimizer steps (``max_steps``). A callback times every step
between ``on_step_begin`` and ``on_step_end`` (synchronized); the first ``--skip`` steps of a round
(optimizer state re-created by ``train()``, the compile on round 1) are left out of the median and kept
as ``first_step_ms``. The step's transient peak is the highest allocation above what was allocated at
that step's start (both models' weights and the optimizer states are resident throughout, so the absolute
peak would count the other variant too). GPU kernel time per step is profiled over one extra round.

    python -m benchmarks hf_trainer [--batch 4] [--seq 2048] [--rounds 5] [--steps 6] [--skip 2]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks._harness import kernel_ms, write


class StepClock:
    """A ``TrainerCallback`` recording each step's wall time (ms) and transient peak (GiB)."""

    def __init__(self):
        import transformers

        clock = self

        class _Callback(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                torch.cuda.synchronize()
                clock.base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                clock.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                torch.cuda.synchronize()
                clock.ms.append((time.perf_counter() - clock.t0) * 1e3)
                clock.peak.append((torch.cuda.max_memory_allocated() - clock.base) / 2**30)

        self.callback, self.ms, self.peak, self.base, self.t0 = _Callback(), [], [], 0, 0.0


def make_trainer(variant: str, data, args_ns, out_dir: str):
    import transformers

    import opsmath
    from benchmarks._models import llama_config
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config("sdpa")).cuda()   # fp32 weights: the AMP recipe
    if variant == "opsmath.optimize":
        model = opsmath.optimize(model)
    targs = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=args_ns.batch, max_steps=args_ns.steps,
        learning_rate=1e-4, bf16=True, torch_compile=variant == "torch_compile=True", report_to=[],
        logging_steps=10**6, save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    clock = StepClock()
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=[clock.callback])
    # Accelerate's state is one object per process: the Trainer built last would set the dynamo plugin of
    # both. Each train() call gets its own Trainer's plugin back (``train_round``).
    trainer.own_dynamo_plugin = trainer.accelerator.state.dynamo_plugin
    return trainer, clock, model


def train_round(trainer) -> None:
    trainer.accelerator.state.dynamo_plugin = trainer.own_dynamo_plugin
    trainer.train()


def kernel_ms_per_step(trainer, steps: int) -> float:
    """GPU kernel time per step over one ``train()`` of ``steps`` steps (``_harness.kernel_ms``)."""
    return sum(kernel_ms(lambda: train_round(trainer), calls=1).values()) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (args.batch * args.steps * 4, args.seq), generator=g)
    data = [dict(input_ids=row, labels=row) for row in ids]
    variants, rows = ["torch_compile=True", "opsmath.optimize"], {}
    with tempfile.TemporaryDirectory() as out:
        built = {v: make_trainer(v, data, args, out) for v in variants}
        per_round = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                trainer, clock, _ = built[v]
                clock.ms.clear(), clock.peak.clear()
                train_round(trainer)
                per_round[v].append((list(clock.ms), list(clock.peak)))
        compiled = type(built["torch_compile=True"][0].model_wrapped).__name__
        if compiled != "OptimizedModule":   # the row would time eager under compile's name
            raise RuntimeError(f"torch_compile=True trained a {compiled}, not a torch.compile'd module")
        for v in variants:
            trainer, clock, model = built[v]
            timed = [statistics.median(ms[args.skip:]) for ms, _ in per_round[v]]
            rows[v] = dict(ms=statistics.median(timed), spread=[min(timed), max(timed)], rounds=timed,
                           first_step_ms=per_round[v][0][0][0],
                           transient_peak_gib=max(max(pk[args.skip:]) for _, pk in per_round[v]),
                           kernel_ms=kernel_ms_per_step(trainer, args.steps))
            if v == "opsmath.optimize":
                import opsmath
                rep = opsmath.report(model)
                rows[v].update(attention_rewrites=rep.count("attention"), rewrites=len(rep.matches),
                               declines=len(rep.declines))
    c, o = rows["torch_compile=True"], rows["opsmath.optimize"]
    speedup = c["ms"] / o["ms"]
    print(f"HF Trainer, LLaMA 1.1B, bf16=True (fp32 weights), B{args.batch} T{args.seq}, "
          f"{args.rounds} rounds x {args.steps} steps")
    for v, r in rows.items():
        print(f"  {v:22s} {r['ms']:8.2f} ms [{r['spread'][0]:.2f}-{r['spread'][1]:.2f}]  GPU {r['kernel_ms']:.2f} ms  "
              f"step peak {r['transient_peak_gib']:.2f} GiB  first step {r['first_step_ms'] / 1e3:.1f} s")
    print(f"  compile / opsmath: {speedup:.3f}x")
    print(write("hf_trainer", dict(args=vars(args), rows=rows, compile_over_opsmath=speedup)))


if __name__ == "__main__":
    main()
