"""Worker processes for tests/test_distributed.py (spawned with torch.multiprocessing; gloo on CPU).

Each worker trains an optimized nanoGPT on its half of a batch under DDP or FSDP2 and writes what the
test checks to ``out_dir``: final full parameters, the report's rewrite count, profiler timings.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist

STEPS, BATCH, SEQ = 3, 4, 16


def _setup(rank, world, port):
    # one compile thread: two ranks each forking an Inductor compile pool oversubscribe a 2-core CI box
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHINDUCTOR_COMPILE_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _finish():
    """Leave the worker once its results are on disk, without interpreter teardown: C++ threads
    (gloo, Inductor's compiled-kernel runtime) destroyed in static teardown can abort the process
    ("terminate called without an active exception", seen once in CI), which mp.spawn reports as a
    failure although every result was already written."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _data():
    from opsmath.examples import gpt
    torch.manual_seed(0)
    model, (idx, tgt) = gpt(batch_size=BATCH, seq_len=SEQ, dropout=0.0)
    batches = []
    for s in range(STEPS):
        g = torch.Generator().manual_seed(s)
        idx = torch.randint(0, 256, (BATCH, SEQ), generator=g)
        batches.append((idx, torch.roll(idx, -1, 1)))
    return model, batches


def single_process_reference(out_dir):
    """The same steps in one process on the whole batch (SGD, mean loss)."""
    model, batches = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for idx, tgt in batches:
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out_dir, "ref.pt"))


def train(rank, world, port, mode, out_dir):
    import opsmath
    _setup(rank, world, port)
    model, batches = _data()
    # FSDP2 also plans recompute (a budget every plan meets), to see it count sharded parameters
    opt_model = opsmath.optimize(model, memory_budget=1.0 if mode == "fsdp" else None,
                                 inductor=True if mode == "ddp_inductor" else None)
    if mode in ("ddp", "ddp_inductor"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        # dynamo's DDP graph splitting (Inductor path) wants the first bucket no larger than the others
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(0.05 * 2**20)
        wrapped = DDP(opt_model, bucket_cap_mb=0.05)   # several buckets, so overlap is visible
    else:
        from torch.distributed.fsdp import fully_shard
        for block in opt_model.h:
            fully_shard(block)
        fully_shard(opt_model)
        wrapped = opt_model
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    per = BATCH // world
    for s, (idx, tgt) in enumerate(batches):
        part = slice(rank * per, (rank + 1) * per)
        if mode == "ddp" and s == STEPS - 1:
            _profile_step(wrapped, idx[part], tgt[part], rank, out_dir)
        else:
            wrapped(idx[part], tgt[part]).backward()
        opt.step()
        opt.zero_grad()
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in wrapped.state_dict().items()}
    if mode == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        dcp.save({"model": get_model_state_dict(wrapped)}, checkpoint_id=os.path.join(out_dir, "dcp"))
    if rank == 0:
        rep = opsmath.report(opt_model)
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in opt_model.parameters())
        torch.save(dict(params=full, attention=rep.count("attention"), calls=[g.calls for g in rep.graphs],
                        resident=[g.plan.resident for g in rep.graphs if g.plan is not None],
                        local_param_bytes=local), os.path.join(out_dir, f"{mode}.pt"))
    _finish()


def _profile_step(wrapped, idx, tgt, rank, out_dir):
    """One DDP step under torch.profiler: when do the all-reduces start, when does backward end?"""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = wrapped(idx, tgt)
        with torch.profiler.record_function("opsmath_test::backward"):
            loss.backward()
    evs = prof.events()
    allreduce = sorted(e.time_range.start for e in evs if "allreduce" in e.name.lower().replace("_", ""))
    bwd = [e for e in evs if e.name == "opsmath_test::backward"][0]
    if rank == 0:
        torch.save(dict(allreduce_starts=allreduce, bwd_start=bwd.time_range.start, bwd_end=bwd.time_range.end),
                   os.path.join(out_dir, "ddp_profile.pt"))
        prof.export_chrome_trace(os.path.join(out_dir, "ddp_trace.json"))


def tune_agree(rank, world, port, out_dir, sync):
    """Ranks whose timings disagree, and whose caches differ (rank 1 already has an entry): with
    OPSMATH_TUNE_SYNC=1 they end up with rank 0's choice for every tuned op, else each keeps its own."""
    from opsmath.kernels import autotune
    os.environ["OPSMATH_CACHE_DIR"] = os.path.join(out_dir, f"cache{rank}")
    os.environ["OPSMATH_TUNE_SYNC"] = sync
    _setup(rank, world, port)
    if rank == 1:
        autotune.store("op", "cached-on-rank-1", dict(choice="b"))
    fast = "a" if rank == 0 else "b"
    measure = (lambda fn: 1.0 if fn.__name__ == fast else 2.0)

    def named(n):
        def fn():
            return None
        fn.__name__ = n
        return fn
    cands = {"a": named("a"), "b": named("b")}
    got = [autotune.pick("op", key, cands, measure) for key in ("measured-by-all", "cached-on-rank-1")]
    torch.save(got, os.path.join(out_dir, f"tune{rank}.pt"))
    _finish()


def fp8_accumulate(rank, world, port, fp8, out_dir):
    """DDP over FP8 linears (``fp8=True`` or ``"cached"``), 2 steps of 2 micro-batches, the first under
    ``no_sync`` (the usual accumulation): writes the parameters and the copies' cast and reuse counts."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import opsmath
    import opsmath.patterns.fp8_linear as rule
    _setup(rank, world, port)
    rule.MIN_DIM = 32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    wrapped = DDP(opsmath.optimize(model, fp8=fp8, inductor=False))
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for step in range(2):
        for micro in range(2):
            x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(10 * step + 2 * micro + rank))
            with wrapped.no_sync() if micro == 0 else contextlib.nullcontext(), torch.autocast("cpu", torch.bfloat16):
                loss = wrapped(x).float().pow(2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        casts = model._opsmath.weight_casts
        torch.save(dict(params={k: v.detach().clone() for k, v in model.state_dict().items()},
                        casts=casts.casts, reused=casts.reused), os.path.join(out_dir, f"fp8-{fp8}.pt"))
    _finish()
