"""Static facts about a captured graph, computed on fake tensors (no real memory, no real compute).

* ``saved_bytes_by_node``: what autograd keeps for backward, per node. The graph runs once on fake
  inputs in an ``fx.Interpreter`` under ``torch.autograd.graph.saved_tensors_hooks``; every saved
  tensor is recorded by its storage (views of one buffer count once) and the storages of graph inputs (parameters, user inputs,
  buffers) are left out: they are resident anyway. Fused ops count what their ``setup_context`` saves
  (attention: q, k, v, out and the per-row stats), which is exactly what makes them lighter.
* ``partitioned_saved_bytes``: what a graph Inductor compiles really keeps. AOTAutograd's min-cut
  partitioner recomputes cheap ops in backward instead of saving their outputs (a norm's fp32
  intermediates, autocast's bf16 weight copies, an activation's output), so eager's saved set
  overstates it: on a small HF LLaMA under bf16 autocast by 48%, on LLaMA 1.1B about 2x (the H200
  budget runs). Inductor's own compile is run up to its partition and stopped there.
* ``kernel_launches``: ops that launch device work, i.e. every call except views, tuple indexing
  and host-side helpers: a forward-pass estimate of launches, good for before/after comparisons.
"""
from __future__ import annotations

import contextlib
import logging
import operator

import torch
import torch.fx as fx

from opsmath.memory import weight_casts
from opsmath.rewrite.canonicalize import aten, size_hint

log = logging.getLogger("opsmath")

_NO_LAUNCH = {
    operator.getitem, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.transpose.int, aten.permute.default, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.default, aten.slice.Tensor, aten.select.int, aten.alias.default,
    aten.t.default, aten.split.Tensor, aten.split_with_sizes.default, aten.detach.default,
    aten.as_strided.default, aten.scalar_tensor.default, aten.lift_fresh_copy.default,
    aten.detach_.default, aten.unbind.int, aten.chunk.default,
}


def kernel_launches(gm: fx.GraphModule) -> int:
    """Forward-pass ops that launch device work (an estimate: views and host helpers excluded; the
    graph's one dropout-seed draw counts, it is a kernel on the device)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target not in _NO_LAUNCH)


@contextlib.contextmanager
def _hooks_applied():
    """Saved-tensor hooks applied even while a graph is being traced (capture turns them off, as
    dynamo does, so that the user's hooks never see fake tensors): this analysis counts through its own."""
    set_tracing = getattr(torch._C._autograd, "_saved_tensors_hooks_set_tracing", None)
    prior = set_tracing(False) if set_tracing is not None else None
    try:
        yield
    finally:
        if set_tracing is not None:
            set_tracing(prior)


class SavedBytes(dict):
    """``{node name: bytes it saves for backward}``, and in ``pairs`` each saved storage as ``(saver,
    producer, bytes)``: the node that saves it and the node whose output first held it (a view's bytes
    go to the node that made its storage). ``casts``: of those bytes, the low-precision copies of
    parameters (autocast's weight casts, ``weight_casts``) by node, where Inductor's partition is read;
    ``copies``: the (saver, producer) pairs of ``pairs`` that are a narrowing copy of the producer's
    output made inside the saver (autocast's bf16 copy of a norm's output in the GEMM it feeds), not
    the output itself."""
    pairs: list

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.casts: dict[str, int] = {}
        self.copies: set[tuple[str, str]] = set()


def saved_bytes_by_node(gm: fx.GraphModule, requires_grad: list[bool]) -> SavedBytes | None:
    """Bytes each node saves for backward when ``gm`` runs on its placeholders' fake values (input i
    requiring grad as ``requires_grad[i]`` says). A storage belongs to the first node that saves it
    (views count once); graph inputs are excluded. None when the graph cannot run on fake tensors."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [v for v in vals if isinstance(v, torch._subclasses.FakeTensor)]
    if not fakes:
        return None
    owner: dict[int, tuple[str, int]] = {}
    maker: dict[int, str] = {}   # storage -> the node whose output first held it
    held = []   # every output kept alive through the run, so no storage address is reused for another

    def key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    class Attributing(fx.Interpreter):
        current = ""

        def run_node(self, n):
            Attributing.current = n.name
            out = super().run_node(n)
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    maker.setdefault(key(t), n.name)
                    held.append(t)
            return out

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            owner.setdefault(key(t), (Attributing.current, size_hint(t.untyped_storage().nbytes())))
        return t

    try:
        with fakes[0].fake_mode, torch.enable_grad():
            inputs = [v.detach().requires_grad_(rg) if isinstance(v, torch.Tensor) and v.is_floating_point()
                      else v for v, rg in zip(vals, requires_grad)]
            input_keys = {key(v) for v in inputs if isinstance(v, torch.Tensor)}
            with _hooks_applied(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                Attributing(gm).run(*inputs)
    except Exception as e:  # an estimate for the report and the planner, never fatal
        log.debug("opsmath: saved-bytes analysis failed: %s", e)
        return None
    out = SavedBytes()
    out.pairs = []
    for k, (name, nbytes) in owner.items():
        if k not in input_keys:
            out[name] = out.get(name, 0) + nbytes
            out.pairs.append((name, maker.get(k, name), nbytes))
    return out


class _Partitioned(Exception):
    """Raised from inside Inductor's compile once the partition is known: nothing more is needed."""


def partitioned_saved_bytes(gm: fx.GraphModule, example_inputs: list) -> SavedBytes | None:
    """Bytes Inductor's compile of ``gm`` saves for backward, per node of ``gm``: ``compile_fx`` runs on a
    copy (Inductor's decompositions and joint-graph passes, as the real compile) until its min-cut
    partition, whose saved values (the backward graph's inputs other than tangents; graph inputs and their
    views left out) are attributed to the node of ``gm`` whose output first held their storage, read from
    ``from_node`` provenance (a node a decomposition added has none: the nearest earlier node with one).
    Storages count once; the low-precision copies of parameters among them are also in ``casts``
    (``weight_casts``: the plan may recompute them) and not in ``pairs``; a narrowing copy of an activation
    (autocast's bf16 copy of a norm's fp32 output, inside the GEMM it feeds) is in ``pairs`` as made by
    that activation's producer, whose recompute frees it (``weight_casts.recomputed_casts``). Call it where
    the real compile runs (same autocast and grad modes). None when the partition cannot be reached
    (no input needs a gradient, an Inductor that partitions elsewhere, a failure): the caller keeps the
    eager estimate (``saved_bytes_by_node``)."""
    import torch._inductor.compile_fx as inductor
    from opsmath.memory.plan import clone_graph_module
    partition = getattr(inductor, "min_cut_rematerialization_partition", None)
    if partition is None or not any(getattr(t, "requires_grad", False) for t in example_inputs):
        return None
    names = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    known, found, casts, copies = set(names), {}, set(), {}
    params = weight_casts.param_positions(gm, example_inputs)

    def stop_at_partition(joint, inputs, **kwargs):
        fw, bw = partition(joint, inputs, **kwargs)
        owner, last = {}, names[0]   # storage -> node of gm; a node without provenance: the last one with
        for n in fw.graph.nodes:
            val = n.meta.get("val")
            if n.op == "placeholder":
                if isinstance(val, torch.Tensor):
                    owner[val.untyped_storage()._cdata] = None
                continue
            src = getattr((n.meta.get("from_node") or [None])[0], "name", None)
            last = src if src in known else last
            if isinstance(val, torch.Tensor):
                owner.setdefault(val.untyped_storage()._cdata, last)
                if weight_casts.is_param_cast(n, params):
                    casts.add(val.untyped_storage()._cdata)
                elif weight_casts.narrowing(n):   # autocast's copy of an activation: made by the value's producer
                    made = getattr((n.args[0].meta.get("from_node") or [None])[0], "name", None)
                    copies.setdefault(val.untyped_storage()._cdata, made if made in known else None)
        for n in bw.graph.find_nodes(op="placeholder"):
            val = n.meta.get("val")
            if n.name.startswith("tangents") or not isinstance(val, torch.Tensor):
                continue
            store = val.untyped_storage()
            name = owner.get(store._cdata, names[-1])
            if name is not None:   # None: a graph input or a view of one, resident anyway
                found.setdefault(store._cdata, (name, size_hint(store.nbytes()), store._cdata in casts,
                                                copies.get(store._cdata) or name, store._cdata in copies))
        raise _Partitioned
    inductor.min_cut_rematerialization_partition = stop_at_partition
    try:
        # a planned graph is read with the casts its plan recomputes tagged, as it compiles
        tag = weight_casts.joint_pass(gm, example_inputs)
        tagging = dict(joint_custom_post_pass=tag) if tag else {}
        with torch._functorch.config.patch(enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False, **tagging):
            inductor.compile_fx(clone_graph_module(gm), list(example_inputs))
        log.warning("opsmath: Inductor compiled without reaching its partition; the memory plan uses eager "
                    "autograd's saved set (larger than Inductor's)")
        return None
    except _Partitioned:
        pass
    except Exception as e:  # an estimate for the planner, never fatal
        log.warning("opsmath: Inductor's partition could not be analyzed (%s: %s); the memory plan uses eager "
                    "autograd's saved set (larger than Inductor's)", type(e).__name__, str(e)[:300])
        return None
    finally:
        inductor.min_cut_rematerialization_partition = partition
    out = SavedBytes()
    out.pairs = []
    for name, nbytes, cast, maker, copy in found.values():
        out[name] = out.get(name, 0) + nbytes
        if cast:   # not an output of the node: the selective candidates leave it out, the casts steps take it
            out.casts[name] = out.casts.get(name, 0) + nbytes
        else:
            out.pairs.append((name, maker, nbytes))
            if copy and maker != name:
                out.copies.add((name, maker))
    return out


def to_networkx(gm: fx.GraphModule):
    """The graph as a ``networkx.DiGraph``: nodes by name with ``op`` and ``label`` attributes, an edge
    from every input to its user. For drawing and for graph algorithms (dominators, generations)."""
    import networkx as nx
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            label = str(n.target).replace("aten.", "").replace(".default", "") \
                if isinstance(n.target, torch._ops.OpOverload) else getattr(n.target, "__name__", str(n.target))
        else:
            label = n.op
        g.add_node(n.name, op=n.op, label=label)
        for i in n.all_input_nodes:
            g.add_edge(i.name, n.name)
    return g


class DeferredSavedBytes:
    """The report's bytes saved for backward, before -> after rewriting, computed at their first read rather
    than inside the first step: two fake-tensor runs of the whole graph (about a tenth of opsmath's capture
    of an 8-layer decoder on CPU) that only the report and the per-match deltas use.

    ``before`` and ``after`` are graphs as they were then (copies: rewriting and compiling change the
    originals; ``before`` None where data-dependent sizes make it slow to run), or ``after`` already counted
    (``SavedBytes``, where a memory budget needed it at once).
    ``matches`` get their ``saved_delta`` (replacement minus replaced) when the counts are made."""

    def __init__(self, before: fx.GraphModule | None, after, requires_grad: list, matches: list):
        self._args: tuple | None = (before, after, requires_grad, matches)
        self.value: tuple = (None, None)

    def get(self) -> tuple:
        if self._args is not None:
            before_gm, after, requires_grad, matches = self._args
            self._args = None   # once (and the graph copies freed)
            before = saved_bytes_by_node(before_gm, requires_grad) if before_gm is not None else None
            if isinstance(after, fx.GraphModule):
                after = saved_bytes_by_node(after, requires_grad)
            if before is not None and after is not None:
                for m in matches:
                    m.saved_delta = (sum(after.get(n, 0) for n in m.inserted)
                                     - sum(before.get(n, 0) for n in m.nodes))
            self.value = (sum(before.values()) if before is not None else None,
                          sum(after.values()) if after is not None else None)
        return self.value
