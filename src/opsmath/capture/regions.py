"""Regions of a captured graph that opsmath leaves to eager, and the split around them.

Dynamo keeps constructs with their own autograd semantics in its graph as higher-order ops: a user
``torch.autograd.Function`` becomes ``autograd_function_apply(fwd_body, bwd_body, ...)``, a
``tensor.register_hook`` inside ``forward`` becomes ``register_hook(tensor, hook_body)``. Lowering to
pre-dispatch ATen (``capture.lower_to_aten``) traces *through* them: a Function's forward is inlined
under ``no_grad`` (its custom backward and every gradient upstream of it are lost) and a hook
registered on a fake tensor never reaches the real one. Both change training silently.

So before lowering, every such node is cut out of the graph (``split_module``) and runs as dynamo
traced it, which executes the higher-order op eagerly with its real semantics (the Function's own
backward, the hook on the real tensor). The runs of ordinary nodes between them are lowered,
rewritten and compiled on their own, each a graph of the report; the report lists every region left
eager with its reason, and dynamo's graph breaks (the code around them runs as plain Python).
Higher-order ops whose lowering is exact stay in the pieces (``LOWERED``); any other, known today or
added by a later torch, is left to eager. Where the graph goes to Inductor, a Function's own piece is
compiled by Inductor, as ``torch.compile`` compiles it (``compile_functions``).
"""
from __future__ import annotations

import contextlib
import copy
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import CheckpointPolicy

from opsmath.capture.frames import source_location
from opsmath.capture.pieces import LazyPiece
from opsmath.meta_keys import USER_REGION

# Higher-order ops ``make_fx(pre_dispatch=True)`` lowers without changing values or gradients:
# ``wrap`` is a plain call; flex_attention stays one op with its own backward.
LOWERED = {"wrap", "flex_attention", "flex_attention_backward"}
CHECKPOINT = "tag_activation_checkpoint"

FUNCTION = "autograd_function_apply"
# where the graph is compiled by Inductor: a Function dynamo traced (forward and backward bodies) is
# compiled as ``torch.compile`` compiles it, AOTAutograd keeping its backward
FUNCTION_COMPILED = "compiled by Inductor with its own backward, as torch.compile compiles it"
HOP_COMPILED = "compiled by Inductor, as torch.compile compiles it (not lowered: not rewritten)"
# dynamo settings for capture: a checkpointed region whose body writes a Python attribute or global
# (transformers 5's layers set and reset the ``kernels`` package's context variable in every checkpointed
# layer) is traced with its side effects run once, in forward. Dynamo's default breaks the graph there and
# the layers run eagerly, as under torch.compile. Eager runs such side effects again in the recompute; the
# tensors computed are the same, and the report's checkpoint rows say so.
CHECKPOINT_SIDE_EFFECTS = {k: True for k in ("skip_fwd_side_effects_in_bwd_under_checkpoint",)
                           if hasattr(torch._dynamo.config, k)}
_WHY = {
    FUNCTION: ("autograd.Function", "custom backward kept as written"),
    "register_hook": ("tensor hook", "hook registered on the real tensor"),
    CHECKPOINT: ("checkpoint", "recomputed in backward as written (RNG preserved); its body is rewritten; "
                 "Python side effects in it run once, in forward"),
}


@dataclass
class EagerRegion:
    """One node of a captured graph that runs as dynamo traced it (not lowered, not rewritten)."""
    kind: str           # "autograd.Function", "tensor hook", "higher-order op <name>"
    location: str       # file.py:line of the user code
    code: str
    reason: str

    def to_dict(self) -> dict:
        return dict(kind=self.kind, location=self.location, code=self.code,
                    reason=self.reason)


def eager_nodes(gm: fx.GraphModule) -> dict[fx.Node, EagerRegion]:
    """The nodes of dynamo's graph ``gm`` that must not be lowered, each with its region record. A
    ``torch.utils.checkpoint`` region is one (lowering through it would drop its recompute): it runs
    through ``run_checkpoint`` with its body compiled as a graph of its own."""
    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.HigherOrderOperator):
            continue
        name = n.target.name()
        if name in LOWERED:
            continue
        kind, reason = _WHY.get(name, (f"higher-order op {name}", "opsmath does not lower it; runs as traced"))
        if name == CHECKPOINT and not checkpoint_body_is_plain(gm, n):
            reason = "selective checkpoint (context_fn): runs as traced"
        loc, code = source_location(n)
        out[n] = EagerRegion(kind, loc, code, reason)
    return out


def split_around(gm: fx.GraphModule, keep: set[fx.Node]) -> tuple[fx.GraphModule, list[str], dict]:
    """Split ``gm`` into a parent calling submodules in the original order: each node of ``keep`` alone
    in its own submodule, each run of other nodes between them in one. Returns the parent, the
    names of the submodules to lower (the runs of ordinary nodes that compute something), and the
    submodule name of each kept node."""
    part, prev_alone, ids, lowered = -1, None, {}, set()
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        if n.target is operator.getitem and n.args[0] in keep:   # unpacks a kept node's outputs
            ids[n] = ids[n.args[0]]
            continue
        alone = n in keep
        if alone or prev_alone is not False:   # a kept node, or the first ordinary node after one
            part += 1
        ids[n] = part
        if not alone:
            lowered.add(part)
        prev_alone = alone
    parent, names = split_by(gm, ids, keep, lowered)
    alone = {n: f"submod_{ids[n]}" for n in keep if hasattr(parent, f"submod_{ids[n]}")}
    return parent, names, alone


def split_by(gm: fx.GraphModule, ids: dict, keep: set[fx.Node], lowered: set[int]) -> tuple[fx.GraphModule, list[str]]:
    """``gm`` split into a parent calling submodule ``submod_<ids[n]>`` for each node, in the original
    order (index values copied into the pieces that read them: ``recompute_in_pieces``). Returns the
    parent and the names of the pieces of ``lowered`` that compute something."""
    recompute_in_pieces(gm, ids, keep)
    parent = split_module(gm, None, lambda n: ids[n], keep_original_order=True)
    names = [f"submod_{p}" for p in sorted(lowered) if hasattr(parent, f"submod_{p}")]
    for name in names:   # pieces keep dynamo's graph id: their parameters stay static inputs (capture.py)
        if "dynamo_compile_id" in gm.meta:
            getattr(parent, name).meta["dynamo_compile_id"] = gm.meta["dynamo_compile_id"]
    return parent, [s for s in names if _computes(getattr(parent, s))]


# ops whose value is not a function of their arguments alone (random draws, uninitialized memory) or
# whose call has an effect: never recomputed in another piece
_IMPURE = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson", "exponential",
           "empty", "seed", "print", "assert")
_SIZES = {"size", "dim", "numel", "sym_size"}   # read a tensor's sizes only, not its values
# Python's in-place operators (``operator.and_`` is out of place, ``operator.iand`` is not)
_INPLACE_OPERATORS = {"setitem", "delitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
                      "iand", "ior", "ixor", "ilshift", "irshift", "imatmul", "iconcat"}
# nodes a copied value may depend on, at most (HF's mask chains are 10-30 nodes)
COPY_LIMIT = 64


def _name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))


def _pure(n: fx.Node) -> bool:
    """A deterministic, out-of-place call (by its name: an ``op_`` method or torch function mutates its
    input, an ``operator`` function is in place only as ``i<op>``)."""
    if n.op not in ("call_function", "call_method") or "out" in n.kwargs:
        return False
    name = _name(n)
    if getattr(n.target, "__module__", None) in ("_operator", "operator"):
        return name not in _INPLACE_OPERATORS
    if name.startswith("__") and name.endswith("__"):   # a Tensor operator method (dynamo's ``__eq__`` in
        return name[2:-2] not in _INPLACE_OPERATORS      # torch 2.11 where 2.13 records ``operator.eq``)
    return not (name.startswith("_") or name.endswith("_") or any(w in name for w in _IMPURE))


def index_only(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of ``gm`` computed by pure ops (``_pure``) from sizes, constants and integer or boolean
    inputs that need no gradient (token ids, an attention mask): HF's causal and padding masks, ALiBi,
    position ranges. Floating tensors (activations, parameters) are never among their inputs, so a copy
    of such a value costs index arithmetic, not model compute."""
    ok = set()
    for n in gm.graph.nodes:
        val = n.meta.get("example_value", n.meta.get("val"))
        if n.op == "placeholder":
            if not isinstance(val, torch.Tensor) or not (val.requires_grad or val.is_floating_point()
                                                         or val.is_complex()):
                ok.add(n)
            continue
        if _pure(n) and (_name(n) in _SIZES or all(a in ok for a in n.all_input_nodes)):
            ok.add(n)
    return ok


def _chain(a: fx.Node, ok: set) -> tuple[set, bool]:
    """``a`` and the ancestors it is computed from within ``ok`` (inputs of the graph excluded; at most
    ``COPY_LIMIT + 1`` of them), and whether it also reads something outside ``ok`` (a size read of an
    activation: that value can only be passed in, not computed again)."""
    seen, stack, outside = set(), [a], False
    while stack and len(seen) <= COPY_LIMIT:
        n = stack.pop()
        if n.op == "placeholder" or n in seen:
            continue
        if n not in ok or any(x not in ok for x in n.all_input_nodes):
            outside = True
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen, outside


def recompute_in_pieces(gm: fx.GraphModule, ids: dict, keep: set[fx.Node]) -> int:
    """Give each piece its own copy of the index values (``index_only``) it reads from another piece,
    instead of receiving them as inputs. Why: a piece after a Function region sees HF's causal mask and
    ALiBi bias as opaque inputs, so its attention match can neither recognize the mask as causal nor
    the bias as per-key, and falls back to a materialized (B, H, S, S) bias with no causal skipping (HF
    BLOOM: 7 of 8 layers). The copies compute the same values (deterministic ops of the same inputs);
    what a rewrite leaves unused is dead code for Inductor. Only values wholly computed from ``index_only``
    nodes and graph inputs are copied, at most ``COPY_LIMIT`` nodes each (nothing that reads an activation,
    not even its size); a kept checkpoint's body gets the same (``copy_into_body``). Returns the nodes copied."""
    ok, copies = index_only(gm), {}

    def copy_into(a: fx.Node, piece: int) -> fx.Node:
        if a.op == "placeholder" or ids.get(a) == piece:
            return a
        if (piece, a) not in copies:
            c = gm.graph.node_copy(a, lambda x: copy_into(x, piece))
            ids[c] = piece
            copies[piece, a] = c
        return copies[piece, a]

    def copyable(a: fx.Node) -> bool:
        chain, outside = _chain(a, ok)
        return a in chain and not outside and len(chain) <= COPY_LIMIT

    for u in list(gm.graph.nodes):
        if u in keep and u.op == "call_function" and _name(u) == CHECKPOINT:
            copy_into_body(gm, u, ok)
        if u not in ids or u in keep or (u.target is operator.getitem and u.args[0] in keep):
            continue
        for a in u.all_input_nodes:
            if ids.get(a, ids[u]) != ids[u] and isinstance(a.meta.get("example_value", a.meta.get("val")), torch.Tensor) \
                    and copyable(a):
                with gm.graph.inserting_before(u):
                    u.replace_input_with(a, copy_into(a, ids[u]))
    return len(copies)


def copy_into_body(gm: fx.GraphModule, node: fx.Node, ok: set) -> int:
    """For a checkpoint ``node`` of ``gm``: each operand computed from constants alone (``ok``: index
    values; no input of ``gm`` among its ancestors, at most ``COPY_LIMIT`` nodes) is computed again
    inside the checkpoint's body, whose own input for it is then unused. The body then sees HF's causal
    mask being built, as the pieces do (``recompute_in_pieces``). Returns the operands copied."""
    body = getattr(gm, node.args[0].target, None) if isinstance(node.args[0], fx.Node) else None
    if not isinstance(body, fx.GraphModule):
        return 0
    pos, copied = {n: i for i, n in enumerate(gm.graph.nodes)}, 0
    holders = list(body.graph.find_nodes(op="placeholder"))
    for ph, a in zip(holders, node.args[1:]):
        chain, outside = _chain(a, ok) if isinstance(a, fx.Node) else (set(), True)
        if outside or a not in chain or len(chain) > COPY_LIMIT or not ph.users \
                or any(x.op == "placeholder" for n in chain for x in n.all_input_nodes):
            continue   # the body cannot compute it: it reads an input of gm (or is too long)
        env = {}
        first = next(n for n in body.graph.nodes if n.op != "placeholder")
        with body.graph.inserting_before(first):
            for n in sorted(chain, key=pos.__getitem__):
                env[n] = body.graph.node_copy(n, env.__getitem__)
        ph.replace_all_uses_with(env[a])
        copied += 1
    if copied:
        body.recompile()
    return copied


def _computes(sub: fx.GraphModule) -> bool:
    """Whether a piece holds anything but grad-mode / autocast bookkeeping and getitems."""
    skip = {torch._C._set_grad_enabled, torch.amp._enter_autocast, torch.amp._exit_autocast, operator.getitem}
    return any(n.op in ("call_function", "call_method", "call_module") and n.target not in skip
               for n in sub.graph.nodes)


def compile_functions(parent: fx.GraphModule, regions: dict, alone: dict, compile_fx, errors: list) -> None:
    """Under Inductor: each user ``autograd.Function`` dynamo traced (its node alone in a submodule of
    ``parent``) is compiled by ``compile_fx(gm, args)`` at its first call, as ``torch.compile`` compiles
    it: AOTAutograd traces its forward body and keeps its backward body as the gradient; so is every other
    higher-order op opsmath does not lower (``cond``, ``scan``, ``associative_scan``: control flow), tensor
    hooks and checkpoints excepted. Where that fails the region runs as traced, and ``errors`` says so. A
    region is compiled for at most ``PIECE_SIZES`` input sizes (each compile is specialized to its sizes);
    further sizes run as traced."""
    def compiler(label: str):
        def compile_region(gm, args):
            try:
                with hooks_off_while_tracing():   # on a copy: Inductor may rewrite the graph it gets (its output)
                    return compile_fx(copy.deepcopy(gm), args)
            except Exception as e:  # noqa: BLE001  (the region still runs, as dynamo traced it)
                errors.append(f"{label}: Inductor failed ({type(e).__name__}: {str(e)[:200]}); running it as traced")
                return gm.forward
        return compile_region
    for node, region in regions.items():
        name = node.target.name()
        if (name == FUNCTION or name not in _WHY) and node in alone:   # Functions, control flow (cond, scans)
            label = "an autograd.Function region" if name == FUNCTION else f"a {name} region"
            setattr(parent, alone[node], LazyPiece(getattr(parent, alone[node]), compiler(label), errors, label))
            region.reason = FUNCTION_COMPILED if name == FUNCTION else HOP_COMPILED


def hooks_off_while_tracing():
    """Saved-tensor hooks disabled while a graph is traced (dynamo's own context where it has one)."""
    off = getattr(torch._dynamo.utils, "_disable_saved_tensors_hooks_during_tracing", None)
    return off() if off is not None else contextlib.nullcontext()


def checkpoint_body_is_plain(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether a checkpoint node's body can run through ``run_checkpoint``: not a selective checkpoint
    (a ``context_fn`` policy, which dynamo keeps in the body's meta)."""
    body = getattr(gm, node.args[0].target, None)
    return isinstance(body, fx.GraphModule) and "_checkpoint_context_fn" not in body.meta


def run_checkpoint(body, *args, **kwargs):
    """A ``torch.utils.checkpoint.checkpoint`` call as the user wrote it (``use_reentrant``,
    ``preserve_rng_state`` ... as given), on ``body``: a ``LazyPiece``, compiled here first, outside
    the checkpoint's saved-tensor hooks. The recompute in backward re-runs the compiled body; with the
    RNG state preserved its dropout seeds (drawn from torch's generator) repeat."""
    from torch._higher_order_ops.wrap import TagActivationCheckpoint
    from torch.utils.checkpoint import checkpoint
    ckpt_kwargs, body_kwargs = TagActivationCheckpoint.divide_kwargs(kwargs)
    body.compile_for(args)
    return checkpoint(body, *args, **ckpt_kwargs, **body_kwargs)


def inline_checkpoint(gm: fx.GraphModule, node: fx.Node, tag: Optional[int] = None,
                      region: Optional[int] = None) -> bool:
    """Replace a plain checkpoint node of dynamo's graph ``gm`` by its body's nodes. Untagged, the
    user's region then computes inline and opsmath's recompute plan decides what to recompute; with
    ``tag`` (a region id), every body node is marked ``PREFER_RECOMPUTE`` with ``ac_graph_id=tag``,
    which is how ``torch.compile`` lowers a checkpoint: the tags survive the ATen re-trace
    (``preserve_node_meta``) and opsmath's rewrites (``RewriteContext.call``), and AOTAutograd's
    partitioner recomputes the region inside the compiled backward. With ``region`` (an id), the body's
    nodes carry ``meta["custom"][USER_REGION]``: the plan offers the region as one candidate segment
    (``opsmath.memory.segments.user_segments``). Only a body without attributes of
    its own (no nested higher-order op) and without keyword arguments for it; returns whether it was
    inlined."""
    from torch._higher_order_ops.wrap import TagActivationCheckpoint
    body = getattr(gm, node.args[0].target, None)
    if not checkpoint_body_is_plain(gm, node) or TagActivationCheckpoint.divide_kwargs(node.kwargs)[1] \
            or any(n.op == "get_attr" for n in body.graph.nodes) \
            or any(u.target is not operator.getitem for u in node.users):
        return False
    inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
    env = dict(zip(inputs, node.args[1:]))
    with gm.graph.inserting_before(node):
        outs = gm.graph.graph_copy(body.graph, env)
    for old, new in env.items():
        if old.op in ("call_function", "call_method", "call_module") and isinstance(new, fx.Node):
            if tag is not None:
                new.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                new.meta["ac_graph_id"] = tag
            if region is not None:
                new.meta["custom"] = {**(new.meta.get("custom") or {}), USER_REGION: region}
    for u in list(node.users):
        u.replace_all_uses_with(outs[u.args[1]])
        gm.graph.erase_node(u)
    getter = node.args[0]
    gm.graph.erase_node(node)
    if not getter.users:
        gm.graph.erase_node(getter)
    gm.graph.lint()
    gm.recompile()
    return True


def route_checkpoints(parent: fx.GraphModule, compile_piece, errors: Optional[list] = None) -> int:
    """In the pieces of a split graph, make every plain checkpoint node call ``run_checkpoint`` on a
    ``LazyPiece`` of its body (``errors``: where its size limit is reported). Returns how many were routed."""
    routed = 0
    for sub in parent.children():
        if not isinstance(sub, fx.GraphModule):
            continue
        for n in sub.graph.nodes:
            if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator) \
                    and n.target.name() == CHECKPOINT and checkpoint_body_is_plain(sub, n):
                name = n.args[0].target
                setattr(sub, name, LazyPiece(getattr(sub, name), compile_piece, errors, "a checkpoint body"))
                n.target = run_checkpoint
                routed += 1
        sub.recompile()
    return routed
