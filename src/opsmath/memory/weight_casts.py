"""Weight casts, the recompute plan's cheapest bytes under autocast: a parameter's low-precision copy
recomputed in backward instead of saved.

Under ``torch.autocast`` every ``linear`` casts its fp32 weight to bf16 (or fp16) in the forward, and
backward needs that copy again for the input's gradient (``dx = dy @ W``). Inductor's partitioner saves
the copy: its min-cut bans recomputing a node that backward must materialize (the copy feeds a GEMM),
so a model trained with fp32 master weights keeps a second, half-size copy of every matmul weight
alive from its forward to its backward. On HF LLaMA 1.1B (B4 T2048) that is 1.41 of the step's 10.2
GiB of activations; recomputing it reads 4 and writes 2 bytes per weight (priced in ``segments._segments``),
about 1 GB freed per ms of GPU time, two to three times what a recomputed GEMM frees per ms.

The plan (``plan_solve._steps``) may take a segment's weight casts as a step of their own (``"casts"``)
or beside a selective run (``"selective+casts"``); its nodes are marked (``meta["custom"][CASTS]``, which
AOTAutograd copies onto every joint-graph node traced from them) and a joint-graph pass tags each cast
of a parameter traced from a marked node ``MUST_RECOMPUTE``. The recomputed copy is the same cast of the
same parameter, so gradients are bit-identical; a parameter modified in place between forward and
backward makes autograd raise (the parameter is what is saved) instead of using the old copy.

``is_param_cast`` is also what ``analysis.partitioned_saved_bytes`` uses to count those bytes apart.
Only on the Inductor path: op by op, autocast's cache holds the copy whatever is saved.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

CASTS = "opsmath_recompute_casts"   # meta["custom"] key: the parameter casts traced from this node recompute
_AC_ID = 1 << 30   # an ac_graph_id above every segment's: the partitioner never pins a cast as a region output
CAST_OPS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}   # dtype casts in ATen
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default   # aliases its input, though its schema is not a view's


def param_positions(gm: fx.GraphModule, example_inputs) -> frozenset[int]:
    """Positions of the parameters among the joint graph's inputs (``primals_<i + 1>``) when ``gm`` is
    compiled on ``example_inputs``: AOTAutograd puts ``gm``'s own parameters and buffers first (the
    constants a capture registers, such as HF models' ``_tensor_constant0``), then the inputs."""
    own = [*dict(gm.named_parameters(remove_duplicate=False)).values(),
           *dict(gm.named_buffers(remove_duplicate=False)).values()]
    return frozenset(i for i, t in enumerate([*own, *example_inputs]) if isinstance(t, torch.nn.Parameter))


def narrowing(n: fx.Node) -> bool:
    """``n`` casts a float tensor (its first argument, a node) to a narrower float dtype."""
    if n.op != "call_function" or n.target not in CAST_OPS or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    val, out = n.args[0].meta.get("val"), n.meta.get("val")
    return (isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) and val.is_floating_point()
            and out.is_floating_point() and out.dtype.itemsize < val.dtype.itemsize)


def is_view(n: fx.Node) -> bool:
    """``n`` calls an ATen view of its first argument (``_unsafe_view`` included)."""
    return n.op == "call_function" and (getattr(n.target, "is_view", False) or n.target is _UNSAFE_VIEW)


def is_param_cast(n: fx.Node, params: frozenset[int]) -> bool:
    """``n`` (a joint or forward graph's node) casts a parameter (a ``primals_<i + 1>`` placeholder with
    ``i`` in ``params``) to a narrower float dtype. An activation handed in by an earlier graph is not one:
    recomputing its cast would keep the wider tensor alive instead."""
    if not narrowing(n):
        return False
    src = n.args[0]
    while is_view(src) and isinstance(src.args[0], fx.Node):
        src = src.args[0]   # a transposed weight cast after its transpose (an LM head, a down projection)
    if src.op != "placeholder" or not src.name.startswith("primals_"):
        return False
    index = src.name[len("primals_"):]
    return index.isdigit() and int(index) - 1 in params


def mark(nodes) -> None:
    """Mark ``nodes``: the parameter casts traced from them are recomputed in backward."""
    for n in nodes:
        n.meta["custom"] = {**(n.meta.get("custom") or {}), CASTS: True}


def _marked(n: fx.Node) -> bool:
    return bool((n.meta.get("custom") or {}).get(CASTS))


def has_marks(gm: fx.GraphModule) -> bool:
    return any(_marked(n) for n in gm.graph.nodes)


def joint_pass(gm: fx.GraphModule, example_inputs):
    """``tagger``'s pass for ``gm`` compiled on ``example_inputs`` where its plan tagged or marked nodes,
    else None."""
    if not has_marks(gm) and not any("recompute" in n.meta for n in gm.graph.nodes):
        return None
    return tagger(param_positions(gm, example_inputs))


def tagger(params: frozenset[int]):
    """The joint-graph pass for a graph whose parameters are the inputs at ``params``
    (``param_positions``): each parameter cast traced from a marked node becomes ``MUST_RECOMPUTE``
    (overriding the ``MUST_SAVE`` a selective run's GEMM passed on to it), and so does every narrowing
    cast of a value the plan recomputes (``recomputed_casts``)."""
    def tag(graph: fx.Graph) -> None:
        for n in graph.nodes:
            if _marked(n) and is_param_cast(n, params):
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                n.meta["ac_graph_id"] = _AC_ID
        recomputed_casts(graph)
    return tag


def recomputed_casts(graph: fx.Graph) -> None:
    """Joint-graph pass: a narrowing cast of a value tagged ``MUST_RECOMPUTE`` is recomputed with it.
    Autocast casts a GEMM's input inside the GEMM (the cast is traced from it and takes its tag), so a
    norm's output a plan recomputes would otherwise still be saved as the GEMM's bf16 copy of it;
    ``analysis.partitioned_saved_bytes`` counts such a copy as made by the value's producer. Only
    opsmath's plan tags ``MUST_RECOMPUTE``: a user's checkpoint region compiled as ``torch.compile``
    lowers it (``PREFER_RECOMPUTE``) is left as it is."""
    for n in graph.nodes:
        src = n.args[0] if n.args else None
        if narrowing(n) and src.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE \
                and n.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = src.meta.get("ac_graph_id", _AC_ID)
