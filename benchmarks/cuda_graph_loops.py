"""Training loops as people write them, replayed as CUDA graphs: does each give eager's losses and weights?

Each loop trains a small nanoGPT (``opsmath.examples.gpt``, dropout off, fp32) for a few steps from one
initialization on one stream of batches, under each variant, and is compared with eager: every loss and
every final parameter (relative 1e-3, the TF32-free fp32 spread of compiled vs eager kernels). Loops:

- ``plain``: forward, backward, ``step``, ``zero_grad()`` (to ``None``), ``loss.item()`` every step;
- ``zero_grad_in_place``: ``zero_grad(set_to_none=False)``: ``.grad`` is kept and added into;
- ``accumulate``: four micro-batches per optimizer step, ``(loss / 4).backward()``;
- ``loss_history``: losses kept as tensors, read once at the end (``torch.stack(...).tolist()``);
- ``eval_between``: an evaluation forward (``eval()``, ``no_grad``) between backward and ``step``;
- ``changing_batch``: batch sizes 2, 3, 2, 3, ...;
- ``ddp``: the model under ``DistributedDataParallel`` (one NCCL rank), ``plain`` loop.

Variants: ``opsmath.optimize(cuda_graphs=True)``, ``torch.compile(mode="reduce-overhead")`` and plain
``opsmath.optimize`` (no CUDA graphs). A loop that raises is recorded with its error.

    python -m benchmarks cuda_graph_loops [--steps 6]
"""
from __future__ import annotations

import argparse
import copy
import os

import torch

import opsmath
from opsmath.examples import gpt

CFG = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, seq_len=64, dropout=0.0)


def data(steps: int, sizes=(2,), seed: int = 1, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        idx = torch.randint(0, CFG["vocab_size"], (sizes[i % len(sizes)], CFG["seq_len"]), generator=g)
        out.append((idx.to(device), torch.roll(idx, -1, 1).to(device)))
    return out


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def plain(model, batches, zero_to_none=True):
    opt, losses = _sgd(model), []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=zero_to_none)
        losses.append(loss.item())
    return losses


def zero_grad_in_place(model, batches):
    return plain(model, batches, zero_to_none=False)


def accumulate(model, batches, micro=4):
    opt, losses = _sgd(model), []
    for i in range(0, len(batches) - micro + 1, micro):
        for x, y in batches[i:i + micro]:
            loss = model(x, y) / micro
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def loss_history(model, batches):
    opt, kept = _sgd(model), []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        kept.append(loss.detach())
    return torch.stack(kept).tolist()


def eval_between(model, batches):
    opt, losses = _sgd(model), []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        model.eval()
        with torch.no_grad():
            losses.append(model(x, y).item())
        model.train()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


LOOPS = dict(plain=plain, zero_grad_in_place=zero_grad_in_place, accumulate=accumulate,
             loss_history=loss_history, eval_between=eval_between, changing_batch=plain)


def variants():
    return {
        "opsmath (CUDA graphs)": lambda m: opsmath.optimize(m, cuda_graphs=True),
        "torch.compile reduce-overhead": lambda m: torch.compile(m, mode="reduce-overhead"),
        "opsmath": lambda m: opsmath.optimize(m),
    }


def ddp(wrap):
    """``wrap`` for a one-rank NCCL DistributedDataParallel around the variant's model."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    return lambda m: DDP(wrap(m))


def run_loop(name: str, wrap, steps: int, device="cuda") -> dict:
    """Train the same model eagerly and through ``wrap``; compare losses and final weights."""
    loop = LOOPS.get(name, plain)
    batches = data(steps, sizes=(2, 3) if name == "changing_batch" else (2,), device=device)
    torch.manual_seed(0)
    ref, _ = gpt(**CFG)
    ref = ref.to(device)
    model = copy.deepcopy(ref)
    want = loop(ref, batches)
    try:
        got = loop(wrap(model), batches)
    except Exception as e:  # recorded: which loops a variant cannot run is the result
        return dict(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    loss_err = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(got, want))
    w_err = max(((p - q).norm() / q.norm().clamp_min(1e-12)).item()
                for p, q in zip(model.parameters(), ref.parameters()))
    return dict(ok=loss_err < 1e-3 and w_err < 1e-3 and len(got) == len(want), loss_rel_err=loss_err,
                weight_rel_err=w_err)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", default="", help="comma-separated loop names")
    ap.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    names = [n for n in [*LOOPS, "ddp"] if not args.only or n in args.only.split(",")]
    rows = []
    for vname, wrap in variants().items():
        if args.variants and vname not in args.variants.split(","):
            continue
        for name in names:
            torch._dynamo.reset()
            row = dict(variant=vname, loop=name, **run_loop(name, ddp(wrap) if name == "ddp" else wrap,
                                                             args.steps))
            rows.append(row)
            print(f"{vname:32} {name:20} " + ("ok" if row["ok"] else "WRONG") +
                  f"  {row.get('error') or 'loss %.1e weights %.1e' % (row['loss_rel_err'], row['weight_rel_err'])}",
                  flush=True)
    from benchmarks._harness import write
    print("wrote", write("cuda_graph_loops", dict(steps=args.steps, rows=rows)))


if __name__ == "__main__":
    main()
