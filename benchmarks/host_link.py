"""The host link and activation offload on this machine (issue: recompute planning, offload as a third
choice).

1. Copy bandwidth between device memory and pinned host memory, D2H and H2D, on a side stream, alone and
   while bf16 GEMMs run on the default stream (and how much those GEMMs slow down).
2. Inductor's partitioner offload (``torch._functorch.config.enable_activation_offloading``): which of its
   switches this torch has, and on a stack of MLP blocks whose forward GEMM outputs are marked
   ``should_offload``: step time, peak memory and gradients against keeping everything and against
   recomputing the blocks; ``offload-async`` with the side-stream switches (torch 2.11's
   ``record_stream`` fake kernel replaced first: ``fix_stream_fakes``).
3. opsmath's own offload (``src/opsmath/runtime/offload_async.py``: copies on a transfer stream, waits placed
   where the modelled compute covers them): ``opsmath`` marks every block's GEMM outputs, ``opsmath-half``
   the first half of the blocks' (what the forward's compute after them can hide).

    python benchmarks/host_link.py            # on the GPU
"""
from __future__ import annotations

import importlib
import statistics
import time

import torch

from _harness import write

MiB = 2 ** 20


def copy_gbps(nbytes: int, direction: str, busy: bool, rounds: int = 5) -> dict:
    """GB/s of one copy of ``nbytes`` on a side stream; with ``busy`` a GEMM loop runs meanwhile on the
    default stream, whose per-GEMM time is reported too."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = []
    gemm_ms = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if busy:
            g0.record()
            for _ in range(40):
                a @ a
            g1.record()
        with torch.cuda.stream(side):
            s.record(side)
            (host.copy_(dev, non_blocking=True) if direction == "d2h" else dev.copy_(host, non_blocking=True))
            e.record(side)
        torch.cuda.synchronize()
        out.append(nbytes / (s.elapsed_time(e) / 1e3) / 1e9)
        if busy:
            gemm_ms.append(g0.elapsed_time(g1) / 40)
    row = dict(bytes=nbytes, direction=direction, busy=busy, gbps=statistics.median(out), spread=[min(out), max(out)])
    if busy:
        row["gemm_ms"] = statistics.median(gemm_ms)
    return row


def gemm_alone_ms(rounds: int = 5) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = []
    for _ in range(rounds):
        g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g0.record()
        for _ in range(40):
            a @ a
        g1.record()
        torch.cuda.synchronize()
        t.append(g0.elapsed_time(g1) / 40)
    return statistics.median(t)


class Blocks(torch.nn.Module):
    def __init__(self, n=8, c=2048):
        super().__init__()
        self.up = torch.nn.ModuleList(torch.nn.Linear(c, 4 * c, bias=False) for _ in range(n))
        self.down = torch.nn.ModuleList(torch.nn.Linear(4 * c, c, bias=False) for _ in range(n))

    def forward(self, x):
        for u, d in zip(self.up, self.down):
            x = x + d(torch.nn.functional.gelu(u(x)))
        return x.float().pow(2).mean()


def offload_switches() -> dict:
    cfg = torch._functorch.config
    names = ("enable_activation_offloading", "activation_offload_separate_stream", "activation_offload_sink_wait",
             "activation_reload_prefetch", "activation_offload_cpu_gpu_bw")
    have = {n: hasattr(cfg, n) for n in names}
    try:
        importlib.import_module("torch._functorch._activation_offloading.offload_ops")
        have["ao_ops"] = hasattr(torch.ops.ao, "offload")
    except (ImportError, AttributeError):
        have["ao_ops"] = False
    return have


def fix_stream_fakes() -> None:
    """torch 2.11 registers ``streams::record_stream``'s fake kernel with a third argument the op does not
    take (its neighbour ``sync_dealloc``'s signature), so tracing the side-stream offload failed; replace
    it by one of the op's own signature (a no-op where the op is absent or already right)."""
    import inspect
    try:
        importlib.import_module("torch._dynamo.variables.streams")   # registers the streams ops
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        return
    op = OPDEFS.get("streams::record_stream")
    if op is not None and op._abstract_fn is not None and len(inspect.signature(op._abstract_fn).parameters) != 2:
        op.register_fake(lambda tensor, stream_index: None)


def _mark(graph):
    """Joint-graph pass: forward nodes annotated ``custom={"offload": True}`` become ``should_offload``."""
    for n in graph.nodes:
        if (n.meta.get("custom") or {}).get("offload"):
            n.meta["should_offload"] = True


def _opsmath_offload(gm, inputs, half: bool):
    """Inductor with opsmath's transfer-stream offload of the marked GEMM outputs."""
    from torch._inductor.compile_fx import compile_fx
    from opsmath.memory import offload
    from opsmath.runtime import offload_async
    gemms = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    for n in gemms[:len(gemms) // 2] if half else gemms:
        n.meta["custom"] = {**(n.meta.get("custom") or {}), offload.OFFLOAD: True}
    with torch._functorch.config.patch(enable_autograd_cache=False), offload_async.offloading(gm, inputs):
        return compile_fx(gm, inputs)


def offload_step(mode: str, switches: dict, steps: int = 5) -> dict:
    """One compiled step of ``Blocks`` with its GEMM outputs kept (``keep``), offloaded (``offload``,
    ``offload-async``) or its blocks recomputed (``recompute``)."""
    from torch._inductor.compile_fx import compile_fx
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Blocks().cuda().to(torch.bfloat16)
    x = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def backend(gm, inputs):
        if mode.startswith("opsmath"):
            return _opsmath_offload(gm, inputs, half=mode == "opsmath-half")
        for n in gm.graph.nodes:
            if n.op == "call_module" or (n.op == "call_function" and "linear" in str(n.target)):
                if mode.startswith("offload"):
                    n.meta["custom"] = {"offload": True}
                elif mode == "recompute":
                    from torch.utils.checkpoint import CheckpointPolicy
                    n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                    n.meta["ac_graph_id"] = 1
        patches = dict(joint_custom_post_pass=_mark) if mode.startswith("offload") else {}
        fpatch = {}
        if mode.startswith("offload"):
            fpatch["enable_activation_offloading"] = True
            if mode == "offload-async":
                fix_stream_fakes()
                fpatch.update({k: True for k in ("activation_offload_separate_stream", "activation_offload_sink_wait",
                                                  "activation_reload_prefetch") if switches.get(k)})
        with torch._functorch.config.patch(enable_autograd_cache=False, **fpatch):
            return compile_fx(gm, inputs, config_patches=patches)
    step = torch.compile(model, backend=backend)
    t, peak = [], None
    try:
        for i in range(steps + 1):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            step(x).backward()
            torch.cuda.synchronize()
            if i:
                t.append((time.perf_counter() - t0) * 1e3)
                peak = torch.cuda.max_memory_allocated() - base
        grads = [p.grad.float().clone() for p in model.parameters()] + [x.grad.float().clone()]
        row = dict(mode=mode, ms=statistics.median(t), spread=[min(t), max(t)], peak_gib=peak / 2 ** 30, grads=grads)
        if mode.startswith("opsmath"):
            from opsmath.runtime import offload_async
            p = offload_async.placements[-1]
            row.update(offloaded=len(p.names), offloaded_gib=p.nbytes / 2 ** 30, late=p.late)
        return row
    except Exception as e:   # an unsupported switch on this torch: reported, not fatal
        return dict(mode=mode, error=f"{type(e).__name__}: {str(e)[:300]}")


def main():
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--offload-only", action="store_true", help="skip the copy bandwidth rows")
    args = ap.parse_args()
    rows = []
    alone = gemm_alone_ms()
    print(f"GEMM 8192^3 bf16 alone: {alone:.3f} ms", flush=True)
    for nbytes in () if args.offload_only else (64 * MiB, 512 * MiB, 2048 * MiB):
        for direction in ("d2h", "h2d"):
            for busy in (False, True):
                r = copy_gbps(nbytes, direction, busy)
                rows.append(r)
                print(f"{direction} {nbytes // MiB:5d} MiB {'busy' if busy else 'idle'}: {r['gbps']:.1f} GB/s "
                      f"[{r['spread'][0]:.1f}-{r['spread'][1]:.1f}]"
                      + (f"  GEMM {r['gemm_ms']:.3f} ms ({r['gemm_ms'] / alone - 1:+.1%})" if busy else ""), flush=True)
    switches = offload_switches()
    print("torch", torch.__version__, "offload switches:", switches, flush=True)
    modes = ("keep", "recompute", "offload", *(() if args.offload_only else ("offload-async",)), "opsmath",
             "opsmath-half")
    steps = [offload_step(m, switches) for m in modes]
    ref = steps[0].get("grads")
    for s in steps:
        g = s.pop("grads", None)
        if g is not None and ref is not None:
            s["max_grad_diff"] = max((a - b).abs().max().item() for a, b in zip(g, ref))
        print(s, flush=True)
    print("wrote", write("host_link", dict(gemm_alone_ms=alone, copies=rows, switches=switches, offload_steps=steps)))


if __name__ == "__main__":
    main()
