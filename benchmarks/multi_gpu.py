"""Multi-GPU training with torchrun (NCCL on CUDA, gloo on CPU): DDP or FSDP2 around an opsmath-optimized
model vs the same model under ``torch.compile`` + SDPA, and the single-device run it must equal.

    torchrun --nproc_per_node=2 -m benchmarks multi_gpu --model gpt2 --wrap ddp --variant opsmath
    torchrun --nproc_per_node=2 -m benchmarks multi_gpu --model llama --wrap fsdp --variant compile
    torchrun --nproc_per_node=2 -m benchmarks multi_gpu ... --steps 20 --check DIR     # + DCP checkpoint
    python -m benchmarks multi_gpu ... --single --check DIR     # 1 device, the concatenated batch: compare
    python -m benchmarks multi_gpu --smoke                      # 2 gloo processes on CPU, toy sizes

Models: ``gpt2`` (GPT-2-small, 12x768, per-rank batch 8 x 1024, opsmath on hand-written attention,
compile on SDPA) and ``llama`` (HF LLaMA 1.1B, per-rank batch 4 x 2048, SDPA for both); bf16 weights,
torch fused AdamW (SGD under ``--check``, whose equality is then exact up to reduction order). Rank 0
prints and writes (``$OUT`` or ``benchmarks/results/``): median step ms [min-max] over ``--steps``,
tokens/s per GPU, per-rank peak memory, and from a torch.profiler trace of one step the NCCL kernel time
and the part of it that no compute kernel overlaps (exposed communication). ``--memory-budget`` passes
``optimize(memory_budget=...)`` (per rank: FSDP2's resident part is the local shards). With ``--check``
the final parameters go to ``DIR/params-<world>.pt`` and (2 processes) a DCP checkpoint to ``DIR/dcp``;
``--single`` then loads that checkpoint into a 1-device model and compares both.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import opsmath
from benchmarks import ROOT, command
from benchmarks._harness import write

SIZES = {"gpt2": (8, 1024), "llama": (4, 2048), "tiny": (2, 32)}


def build(name: str, variant: str, device: str):
    from benchmarks._models import GPT2_SMALL, build as gpt_build, hf_llama
    from opsmath.examples import GPT
    torch.manual_seed(0)
    if name == "tiny":
        model = GPT(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0).to(device)
    elif name == "gpt2":
        model = gpt_build(dict(GPT2_SMALL, dropout=0.0), device, "eager" if variant == "opsmath" else "sdpa")
    else:
        model = hf_llama("sdpa", device=device, dtype=torch.float32)
    return model.to(torch.bfloat16) if device == "cuda" else model


def blocks(model):
    return model.h if hasattr(model, "h") else model.model.layers


def wrap(model, how: str, variant: str, budget):
    model = opsmath.optimize(model, memory_budget=budget) if variant == "opsmath" else torch.compile(model)
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in blocks(getattr(model, "_orig_mod", model)):
            fully_shard(block)
        fully_shard(model)
    return model


def batches(name: str, steps: int, world: int, rank: int, device: str, single: bool):
    """Each step's batch: the whole (world x per-rank) batch on one device, else this rank's slice."""
    B, T = SIZES[name]
    vocab = 256 if name == "tiny" else 32000 if name == "llama" else 50304
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, vocab, (B * world, T), generator=g)
        ids = ids if single else ids[rank * B:(rank + 1) * B]
        out.append(ids.to(device))
    return out


def loss_of(model, ids):
    out = model(ids, torch.roll(ids, -1, 1)) if not hasattr(model, "config") and \
        not hasattr(getattr(model, "module", None), "config") else model(input_ids=ids, labels=ids)
    return out if isinstance(out, torch.Tensor) else out.loss


def exposed_comm(prof) -> tuple[float, float]:
    """(NCCL kernel ms, the part of it no other GPU kernel overlaps) in one profiled step. GPU kernels
    are read from the exported Chrome trace (``"cat": "kernel"`` events): ``prof.events()`` does not
    list them as device events on every torch version."""
    import json
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            trace = json.load(g)
    return overlap_ms(kernels_of(trace))


def kernels_of(trace: dict) -> list[tuple[float, float, bool]]:
    """(start us, end us, is NCCL) of every GPU kernel in a Chrome trace."""
    evs = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    return [(e["ts"], e["ts"] + e.get("dur", 0), "nccl" in e.get("name", "").lower())
            for e in evs if e.get("cat") == "kernel" and "ts" in e]


def overlap_ms(kernels: list[tuple[float, float, bool]]) -> tuple[float, float]:
    """(NCCL kernel ms, NCCL ms not covered by any compute kernel) from (start us, end us, is NCCL)."""
    merged: list[list[float]] = []
    for s, e in sorted((s, e) for s, e, nccl in kernels if not nccl):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    total = exposed = 0.0
    for s, e, nccl in kernels:
        if nccl:
            covered = sum(max(0.0, min(e, m1) - max(s, m0)) for m0, m1 in merged)
            total += e - s
            exposed += e - s - covered
    return total / 1e3, exposed / 1e3


def train(args, device: str, rank: int, world: int):
    model = wrap(build(args.model, args.variant, device), "none" if args.single else args.wrap, args.variant,
                 args.memory_budget)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3) if args.check else \
        torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, prof = [], None
    for i, ids in enumerate(batches(args.model, args.steps, world if not args.single else args.world, rank,
                                    device, args.single)):
        t0 = time.perf_counter()
        if i == args.steps - 1 and not args.single:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            with profile(activities=acts) as prof:
                loss_of(model, ids).backward()
        else:
            loss_of(model, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return model, times, prof


def params_of(model) -> dict:
    return {k.removeprefix("module.").removeprefix("_orig_mod."): (v.full_tensor() if hasattr(v, "full_tensor")
                                                                    else v).detach().float().cpu()
            for k, v in model.state_dict().items()}


def report(args, model, times, prof, device, world):
    B, T = SIZES[args.model]
    timed = times[2:] or times
    row = dict(model=args.model, wrap=args.wrap, variant=args.variant, world=world, ms=statistics.median(timed),
               ms_min=min(timed), ms_max=max(timed), tokens_per_s_per_gpu=B * T / statistics.median(timed) * 1e3)
    if device == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if prof is not None:
        row["nccl_ms"], row["exposed_comm_ms"] = exposed_comm(prof)
    print(row, flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2", choices=sorted(SIZES))
    ap.add_argument("--wrap", default="ddp", choices=["ddp", "fsdp"])
    ap.add_argument("--variant", default="opsmath", choices=["opsmath", "compile"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--memory-budget", default=None)
    ap.add_argument("--check", default=None, help="directory for final parameters and the DCP checkpoint")
    ap.add_argument("--single", action="store_true", help="one device, the concatenated batch of --world ranks")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="2 gloo processes on CPU at toy size")
    ap.add_argument("--smoke-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        return smoke()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rank, world = 0, 1
    if not args.single:
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = f"cuda:{torch.cuda.current_device()}"
    model, times, prof = train(args, device.split(":")[0] if device == "cpu" else device, rank, world)
    row = report(args, model, times, prof, device.split(":")[0], world) if rank == 0 else None
    if args.check:
        check(args, model, rank)
    if rank == 0 and not args.smoke_child:
        print("wrote", write(f"multi_gpu-{'nccl' if 'cuda' in device else 'gloo'}-{args.model}-{args.wrap}-{args.variant}"
                                + ("-single" if args.single else ""), row))
    if not args.single:
        del model, prof   # DDP's reducer holds the process group: dropped while its worker is idle
        dist.barrier()
        dist.destroy_process_group()
        # a gloo worker thread can still be freeing the barrier's work, which needs the GIL, while the
        # process group's destructor joins it holding the GIL (seen on a 2-core CI host: rank 0 never
        # exited): skip the native teardown once everything is written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def check(args, model, rank):
    """World > 1: write the parameters and a DCP checkpoint. Single: compare with both."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    os.makedirs(args.check, exist_ok=True)
    mine = params_of(model)
    if not args.single:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(args.check, "dcp"))
        if rank == 0:
            torch.save(mine, os.path.join(args.check, f"params-{dist.get_world_size()}.pt"))
        return
    theirs = torch.load(os.path.join(args.check, f"params-{args.world}.pt"))
    worst = max(((mine[k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in theirs.items())
    fresh = build(args.model, args.variant, next(model.parameters()).device.type)
    state = {"model": get_model_state_dict(fresh)}
    dcp.load(state, checkpoint_id=os.path.join(args.check, "dcp"))
    set_model_state_dict(fresh, state["model"])
    loaded = max((p.detach().float().cpu() - theirs[k]).abs().max().item()
                 for k, p in fresh.state_dict().items() if k in theirs)
    print(f"check: parameters vs {args.world} ranks, worst relative difference {worst:.3g}; "
          f"DCP checkpoint loaded on 1 device, largest difference {loaded:.3g}", flush=True)
    assert loaded == 0.0, "the DCP checkpoint did not load what the ranks trained"
    tol = 1e-5 if next(model.parameters()).dtype == torch.float32 else 2e-2
    assert worst <= tol, f"single-device parameters differ from the {args.world}-rank run: {worst:.3g}"


def smoke():
    """torchrun-equivalent on CPU: 2 gloo ranks (DDP, then FSDP2) and the single-process check."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for how in ("ddp", "fsdp"):
            out = os.path.join(d, how)
            common = ["--model", "tiny", "--wrap", how, "--steps", "3", "--check", out, "--smoke-child"]
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                            "-m", "benchmarks", "multi_gpu", *common], cwd=ROOT, check=True)
            subprocess.run(command("multi_gpu", *common, "--single"), cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
