"""Emission of a recompute plan (``opsmath.memory.plan``) into the graph: ``checkpoint`` calls for eager
execution, recompute tags (and offload marks, ``offload.py``) for Inductor's partitioner."""
from __future__ import annotations

import operator

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from opsmath.memory.segments import Segment, forward_order
from opsmath.memory.selective import KEEPS, node_kept


def policy(kind: str):
    """The selective checkpoint policy of a run of ``kind``: the ops ``selective.KEEPS[kind]`` saved
    (GEMMs and fused GEMM ops; with ``"selective-gemms"`` the fused ops only), the rest recomputed."""
    keeps = KEEPS[kind]

    def keep(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if keeps(op) else CheckpointPolicy.PREFER_RECOMPUTE
    return keep


def selective_checkpoint(fn, *args, gemms=False, **kwargs):
    """``checkpoint(fn, *args)`` that recomputes only the cheap ops (``policy("selective")``), or with
    ``gemms=True`` the plain GEMMs too (``policy("selective-gemms")``)."""
    keep = policy("selective-gemms" if gemms else "selective")
    return checkpoint(fn, *args, context_fn=lambda: create_selective_checkpoint_contexts(keep), **kwargs)


def emit_checkpoints(gm: fx.GraphModule, segs: list[Segment], chosen: list[int], selective=(), gemms=()) -> None:
    """Replace each chosen segment's nodes by a ``checkpoint(sub_graph_module, *inputs)`` call; a
    selective one's call recomputes only its cheap ops (``selective_checkpoint``; those in ``gemms``
    their plain GEMMs too)."""
    order = forward_order(gm)
    for i in sorted([*chosen, *selective], reverse=True):
        seg = segs[i]
        nodes = order[seg.start:seg.end + 1]
        inside = set(nodes)
        ext = []
        for n in nodes:
            for x in n.all_input_nodes:
                if x not in inside and x not in ext:
                    ext.append(x)
        for x in ext:   # a constant (get_attr) sits by its first use, maybe inside the segment: move it up
            if x.op == "get_attr":
                nodes[0].prepend(x)
        outs = [n for n in nodes if any(u not in inside for u in n.users)]
        sub = fx.Graph()
        env = {x: sub.placeholder(x.name) for x in ext}
        for n in nodes:
            env[n] = sub.node_copy(n, lambda x: env[x])
        sub.output(tuple(env[o] for o in outs))
        name = f"opsmath_recompute_{i}"
        gm.add_submodule(name, fx.GraphModule(gm, sub, class_name=name))
        with gm.graph.inserting_before(nodes[0]):
            fn = gm.graph.get_attr(name)
            kw = {"use_reentrant": False, "preserve_rng_state": True}
            call = gm.graph.call_function(selective_checkpoint if i in selective else checkpoint, (fn, *ext),
                                          dict(kw, gemms=True) if i in gemms else kw)
            for j, o in enumerate(outs):
                got = gm.graph.call_function(operator.getitem, (call, j))
                got.meta = dict(o.meta)
                o.replace_all_uses_with(got, delete_user_cb=lambda u: u not in inside)
        for n in reversed(nodes):
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


def tag_recompute(gm: fx.GraphModule, segs: list[Segment], chosen: list[int], selective=(), gemms=()) -> None:
    """Mark each chosen segment's nodes ``MUST_RECOMPUTE`` with the segment as its ``ac_graph_id``:
    the tags selective activation checkpointing leaves for AOTAutograd's partitioner, which then
    saves only the segment's inputs and recomputes the rest inside Inductor's backward graph. In a
    ``selective`` segment the GEMMs and fused GEMM ops are ``MUST_SAVE`` instead (in one of ``gemms``,
    only the fused ops); in one with ``only`` (``"selective-free"``, ``"selective-tensors"``) only those
    nodes are recomputed, GEMMs among them, and the other GEMMs saved."""
    order = forward_order(gm)
    for i in [*chosen, *selective]:
        only = segs[i].only if i in selective else None
        for n in order[segs[i].start:segs[i].end + 1]:
            keep = i in selective and node_kept("selective-gemms" if i in gemms else "selective", n)
            if only is not None:
                if n.name in only:
                    keep = False
                elif not keep:
                    continue   # a cheap op the run leaves to the partitioner
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = i + 1
