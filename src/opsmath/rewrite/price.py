"""Priced rewrites: on a graph Inductor compiles, an occurrence of a family Inductor may fuse as well is
kept only where opsmath's op measures faster at that occurrence's sizes.

Opt-in (``OPSMATH_PRICE=1``). By default the families whose op spec says ``inductor_fuses_better``
(``kernels/_spec.py``: swiglu, bias_gelu, dropout_add_norm, cross_entropy, scaled_softmax and
linear_cross_entropy) are left to Inductor wholesale on such graphs, on the evidence of a few measured
shapes. Priced, each occurrence is decided by its own measurement instead:

1. the rule emits as usual (``RewriteContext.offer``);
2. the nodes the emit erased (the original subgraph) and those it inserted (the replacement) are cut out of
   the graph as two standalone graphs over the same inputs (``cut``): inputs are the nodes outside that
   they read, outputs the nodes of theirs read outside;
3. each is compiled by Inductor (``compile_fx``, as the whole graph will be) and timed forward and backward
   (the outputs' gradients with respect to the inputs that require grad) on random inputs of the
   occurrence's sizes, strides and dtypes: GPU kernel time, ``kernels.autotune.pick``, whose disk cache
   keeps the verdict per GPU and software (op ``price:<family>``; key: the inputs' dtypes and sizes and a
   hash of both graphs' code, so the 12 identical layers of a model are measured once);
4. where Inductor's is not slower, or opsmath's op saves more for backward (the step's peak) and no memory
   budget is planned, the original nodes are put back (``restore``) and the occurrence is declined with
   the times and bytes as its reason. Under a budget, an op that saves less stays even where it is slower.

Caveats. Timed alone, neither side fuses with its neighbours; in the whole graph Inductor may fuse the
original ops with the ops around them, where opsmath's op stays opaque: isolation favours opsmath's op.
Integer inputs are zeros and boolean inputs True (any index is then in range); a data-dependent input
(routing) would be timed on unrepresentative values, so graphs with symbolic or data-dependent sizes are
not priced (the occurrence keeps the family's default). Random draws in the timed graphs (dropout) do
not move the user's random streams (``torch.random.fork_rng``). Measuring compiles two small graphs per
distinct occurrence on the first run: on the H200 GPT-2's first step (B4 T1024, AMP) did not finish within
270 s priced, against 26 s unpriced. So a process spends at most ``OPSMATH_PRICE_SECONDS`` (default 60)
measuring; occurrences met after that are left to Inductor (the report says so) and measured by a later
run, since every verdict is cached.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_symbols


def enabled() -> bool:
    """``OPSMATH_PRICE=1``: price the families Inductor may fuse as well, per occurrence."""
    return os.environ.get("OPSMATH_PRICE", "0") not in ("", "0")


@dataclass
class Snapshot:
    """The graph before an emit: its nodes in order and each one's arguments then."""
    nodes: list
    args: dict

    @classmethod
    def of(cls, graph: fx.Graph) -> "Snapshot":
        nodes = list(graph.nodes)
        return cls(nodes, {n: (n.args, n.kwargs) for n in nodes})


@dataclass
class Cut:
    """A region as a standalone graph: ``gm`` over ``inputs`` (the outside nodes it reads), returning the
    values of ``outputs`` (its nodes read outside)."""
    gm: fx.GraphModule
    inputs: list
    outputs: list


def cut(nodes: list, args_of: Callable, read_outside: Callable) -> Optional[Cut]:
    """``nodes`` (in graph order; only ``call_function`` nodes) as a graph of their own, its nodes named in
    order (``n0``, ``n1``, ...) so that equal regions have equal code. None where a region is not a plain
    computation on tensors (a node of another kind, a non-tensor output)."""
    inside, graph, env, inputs = set(nodes), fx.Graph(), {}, []

    def arg(x):
        if x not in env:
            env[x] = graph.placeholder(f"in{len(inputs)}")
            env[x].meta["val"] = x.meta.get("val")
            inputs.append(x)
        return env[x]
    for i, n in enumerate(nodes):
        if n.op != "call_function":
            return None
        a, k = args_of(n)
        a, k = fx.node.map_arg((a, k), lambda x: env[x] if x in inside else arg(x))
        env[n] = graph.create_node("call_function", n.target, a, k, name=f"n{i}")
        env[n].meta["val"] = n.meta.get("val")
    outputs = [n for n in nodes if read_outside(n)]
    if not outputs or not all(isinstance(n.meta.get("val"), torch.Tensor) for n in outputs):
        return None
    graph.output(tuple(env[n] for n in outputs))
    return Cut(fx.GraphModule(torch.nn.Module(), graph), inputs, outputs)


def regions(graph: fx.Graph, snap: Snapshot) -> Optional[tuple[list, list, Cut, Cut]]:
    """(erased, inserted, original cut, replacement cut) of the emit that turned ``snap`` into ``graph``;
    None where it cannot be priced or put back: nothing erased or inserted, a surviving node moved, or a
    region that does not cut out cleanly."""
    now = list(graph.nodes)
    present = set(now)
    erased = [n for n in snap.nodes if n not in present]
    old = set(snap.nodes)
    inserted = [n for n in now if n not in old]
    survivors = [n for n in now if n in old]
    if not erased or not inserted or survivors != [n for n in snap.nodes if n in present]:
        return None
    gone, new = set(erased), set(inserted)
    readers = {n: [] for n in erased}
    for n in snap.nodes:
        if n not in gone:
            for x in _nodes_in(snap.args[n]):
                if x in gone:
                    readers[x].append(n)
    original = cut(erased, snap.args.__getitem__, lambda n: bool(readers[n]))
    replacement = cut(inserted, lambda n: (n.args, n.kwargs), lambda n: any(u not in new for u in n.users))
    if original is None or replacement is None:
        return None
    return erased, inserted, original, replacement


def _nodes_in(args) -> list:
    found = []
    fx.node.map_arg(args, found.append)
    return found


def restore(graph: fx.Graph, snap: Snapshot, erased: list, inserted: list) -> dict:
    """Undo an emit: copies of the erased nodes go back where they were (each before the first surviving
    node that followed it), every surviving node whose arguments changed gets its old ones (the copies
    in place of the erased), and the inserted nodes are erased. Returns erased node -> its copy."""
    present, gone, env = set(graph.nodes), set(erased), {}
    order = snap.nodes
    for i, n in enumerate(order):
        if n not in gone:
            continue
        after = next((m for m in order[i + 1:] if m in present), None)
        a, k = fx.node.map_arg(snap.args[n], lambda x: env.get(x, x))
        _release(graph, n.name)   # the copy keeps the original's name (the report's, the user's skips)
        with graph.inserting_before(after):
            env[n] = graph.create_node(n.op, n.target, a, k, name=n.name)
        env[n].meta.update(n.meta)
    for n in order:
        if n in present and (n.args, n.kwargs) != snap.args[n]:
            n.args, n.kwargs = fx.node.map_arg(snap.args[n], lambda x: env.get(x, x))
    for n in reversed(inserted):
        graph.erase_node(n)
    return env


def _release(graph: fx.Graph, name: str) -> None:
    """Free ``name`` in ``graph``'s namespace: fx keeps an erased node's name taken, and a node recreated
    under it would be renamed (``relu`` -> ``relu_1``)."""
    used = getattr(getattr(graph, "_graph_namespace", None), "_used_names", None)
    if isinstance(used, set):
        used.discard(name)


def key(original: Cut, replacement: Cut) -> str:
    """The cache key of one priced occurrence: its inputs' dtypes and sizes, and both graphs' code."""
    vals = [x.meta["val"] for x in original.inputs]
    shapes = " ".join(f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}" if isinstance(v, torch.Tensor)
                      else repr(v) for v in vals)
    code = hashlib.sha1((original.gm.code + replacement.gm.code).encode()).hexdigest()[:12]
    return f"{shapes} #{code}"


def unpriced(c: Cut) -> Optional[str]:
    """Why ``c`` cannot be priced (None: it can): a size not known at capture (symbolic or
    data-dependent), an input that is not a tensor, or tensors off the GPU (priced by GPU kernel time;
    ``MEASURE`` set, as in tests, prices anywhere)."""
    vals = [x.meta.get("val") for x in c.inputs] + [n.meta.get("val") for n in c.outputs]
    if not c.inputs or not all(isinstance(v, torch.Tensor) for v in vals):
        return "an input that is not a tensor"
    if any(free_symbols(v) for v in vals):
        return "sizes not known at capture"
    if MEASURE is None and vals[0].device.type != "cuda":
        return "priced by GPU kernel time, on CUDA only"
    return None


def example(val: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A real tensor like the fake ``val`` (sizes, strides, dtype, device): floats normal, integers zero,
    booleans True."""
    out = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=val.device)
    if out.is_floating_point():
        return out.normal_(generator=generator)
    return out.fill_(True if out.dtype == torch.bool else 0)


def runner(c: Cut, needs_grad: Callable, compile_fn: Callable) -> Callable[[], None]:
    """A zero-argument callable running ``c`` forward and backward; it compiles (``compile_fn(gm,
    inputs)``), draws its inputs and counts what one forward saves for backward (``run.saved``, bytes of
    distinct storages) at its first call."""
    state = {}

    def run():
        if not state:
            dev = c.inputs[0].meta["val"].device
            g = torch.Generator(device=dev).manual_seed(0)
            inputs = [example(x.meta["val"], g) for x in c.inputs]
            for t, x in zip(inputs, c.inputs):
                t.requires_grad_(t.is_floating_point() and needs_grad(x))
            state.update(fn=compile_fn(c.gm, inputs), inputs=inputs,
                         wrt=[t for t in inputs if t.requires_grad])
            run.saved = saved_bytes(lambda: state["fn"](*inputs))
        outs = state["fn"](*state["inputs"])
        outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs and state["wrt"]:
            torch.autograd.grad(outs, state["wrt"], [torch.ones_like(o) for o in outs], allow_unused=True)
    return run


def saved_bytes(forward: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``forward()`` runs."""
    seen: dict = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def inductor(gm: fx.GraphModule, inputs: list):
    """Inductor's compile of ``gm``, forward and backward (what ``torch.compile`` runs on a graph)."""
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, inputs)


MEASURE = None        # tests: the measuring function handed to ``autotune.pick`` (default: kernel time)
SECONDS = 60.0        # measuring time a process spends pricing at most (``OPSMATH_PRICE_SECONDS``)
SPENT = [0.0]         # seconds this process spent measuring so far
_VERDICTS: dict = {}  # (family, key) -> ``verdict``'s answer, this process
COMPILE = inductor    # tests: how both graphs are compiled


def over_budget(family: str, k: str) -> Optional[str]:
    """Why an occurrence is not measured now: its verdict is not cached and this process already spent
    its pricing time (``OPSMATH_PRICE_SECONDS``, default ``SECONDS``: two Inductor compiles per distinct
    occurrence cost GPT-2 minutes on a cold cache); None where it may be measured. ``k``: its ``key``."""
    from opsmath.kernels import autotune
    if (family, k) in _VERDICTS or autotune.cached(f"price:{family}", k) is not None:
        return None
    raw = os.environ.get("OPSMATH_PRICE_SECONDS", SECONDS)
    try:
        limit = float(raw)
    except ValueError:
        raise ValueError(f"OPSMATH_PRICE_SECONDS={raw!r}: seconds of measuring, a number") from None
    if SPENT[0] >= limit:
        return (f"this process spent its {limit:g} s of pricing (OPSMATH_PRICE_SECONDS); verdicts are cached, so "
                "a later run measures more")
    return None


def verdict(family: str, k: str, original: Cut, replacement: Cut, needs_grad: Callable) -> tuple[str, dict, dict]:
    """``("opsmath" | "inductor", {candidate: ms}, {candidate: bytes saved for backward})`` for one
    occurrence (``k``: its ``key``): this process's, else the disk cache's, else measured now (in
    ``isolated()``, the time counted in ``SPENT``); the bytes are {} where the cache has none."""
    from opsmath.kernels import autotune

    if (family, k) in _VERDICTS:   # identical layers: no second read of the cache file
        return _VERDICTS[family, k]
    op = f"price:{family}"
    candidates = {"inductor": runner(original, needs_grad, COMPILE),
                  "opsmath": runner(replacement, needs_grad, COMPILE)}
    for name, fn in candidates.items():
        fn.candidate = name
    t0 = time.perf_counter()
    try:
        with isolated(original.inputs[0].meta["val"].device):
            # no collective (``sync``): whether a rank measures depends on its own cache and time budget
            choice = autotune.pick(op, k, candidates, sync=False,
                                   **({} if MEASURE is None else {"measure_fn": MEASURE}))
    finally:
        SPENT[0] += time.perf_counter() - t0
    entry = autotune.lookup(op, k) or {}
    saved = {name: fn.saved for name, fn in candidates.items() if hasattr(fn, "saved")}
    if len(saved) == 2 and entry and "saved" not in entry:
        autotune.store(op, k, dict(entry, saved=saved))
    _VERDICTS[family, k] = choice, entry.get("ms", {}), saved or entry.get("saved", {})
    return _VERDICTS[family, k]


@contextlib.contextmanager
def isolated(device: torch.device):
    """Measuring inside a compile: none of the caller's compile state reaches the two compiles (dynamo's
    tracing and compile contexts, whose fake mode and shape guards belong to the user's graph), grad on,
    autocast off (the graphs carry their dtypes), and the user's random streams as they were. (In the
    caller's thread: Inductor takes dynamo's compile lock, which the caller holds.)"""
    from torch._guards import compile_context, tracing
    devices = [device.index or 0] if device.type == "cuda" else []
    with tracing(None), compile_context(None), _own_metrics(), torch.enable_grad(), \
            torch.autocast(device.type, enabled=False), torch.random.fork_rng(devices=devices):
        yield


@contextlib.contextmanager
def _own_metrics():
    """A compile metrics record of its own (dynamo keeps one per thread, and Inductor's compile records
    into the caller's, which refuses a second value for the same field)."""
    from torch._dynamo import utils
    tls = getattr(utils, "_metrics_context_tls", None)
    saved = getattr(tls, "metrics_context", None)
    if saved is not None:
        del tls.metrics_context
    try:
        yield
    finally:
        if saved is not None:
            tls.metrics_context = saved


def measured(ms: dict, saved: dict) -> str:
    """``"inductor 0.120 ms, opsmath 0.100 ms; saved for backward: inductor 2.0 MiB, opsmath 1.0 MiB"``."""
    out = ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(ms.items())) or "cached"
    if saved:
        out += "; saved for backward: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(saved.items()))
    return out


def judged(choice: str, ms: dict, saved: dict, budget: bool) -> Optional[str]:
    """None to keep the rewrite, else why the original goes back. Kept where opsmath's op is faster and
    saves no more for backward; under a memory budget also where it saves less, however slower."""
    if choice not in ("opsmath", "inductor"):
        return f"left to Inductor: measuring failed ({choice})"
    less = len(saved) == 2 and saved["opsmath"] < saved["inductor"]
    more = len(saved) == 2 and saved["opsmath"] > saved["inductor"]
    if (budget and less) or (choice == "opsmath" and not more):
        return None
    why = "saves more for backward" if choice == "opsmath" else "is as fast or faster"
    return (f"Inductor's fusion of the original ops {why} at these sizes (forward + backward, GPU kernel "
            f"time: {measured(ms, saved)})")
