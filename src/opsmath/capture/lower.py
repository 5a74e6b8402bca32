"""Capture: lower a dynamo-captured graph to pre-dispatch ATen with fake-tensor metadata.

``torch.fx.symbolic_trace`` fails on most real models (``x.size()`` unpacking, slicing by proxies), so
opsmath captures through a dynamo backend, like ``torch.compile``. Inside the backend, ``make_fx`` with
``pre_dispatch=True`` re-traces dynamo's Torch-level graph into the "training IR": ``aten.linear``,
``matmul``, ``softmax``, ``layer_norm``, ``dropout`` stay whole, method-vs-function and ``@``-vs-``matmul``
spellings disappear, and every node carries ``meta["val"]`` (a fake tensor: shape, dtype, device,
strides, as autocast would produce them) and ``meta["stack_trace"]`` (the user's source line).
"""
from __future__ import annotations

import contextlib
import operator
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

from opsmath.capture.guards import BufferGuard, ReadTracking
from opsmath.capture.scalars import device_scalars


@dataclass
class Captured:
    """A lowered graph plus what the matchers may know about its inputs.

    ``constants`` maps placeholder names to the real tensors of inputs that are module *buffers*
    (e.g. nanoGPT's causal ``tril`` buffer): matchers may read their values to recognize constant
    masks. Parameters and user inputs are never read.
    """
    gm: fx.GraphModule
    constants: dict[str, torch.Tensor] = field(default_factory=dict)   # a ``guards.ReadTracking``
    requires_grad: list[bool] = field(default_factory=list)   # per placeholder, from the real inputs
    positions: dict[str, int] = field(default_factory=dict)   # constant's name -> its input's index
    dynamic: bool = False         # traced with dynamo's symbolic sizes (a dim that changed between calls)

    def buffer_guard(self, example_inputs: list) -> Optional[BufferGuard]:
        """A guard on the buffers whose value a matcher read (``constants.read``), or None."""
        names = sorted(getattr(self.constants, "read", ()))
        if not names:
            return None
        return BufferGuard([self.positions[n] for n in names], names, example_inputs)


def lower_to_aten(gm: fx.GraphModule, example_inputs: list, buffer_ids: Optional[set[int]] = None,
                  sizes_seen: bool = False) -> Captured:
    """Re-trace dynamo's graph ``gm`` to pre-dispatch ATen with fake tensors.

    ``example_inputs`` are what dynamo hands a backend (real tensors; params and buffers lifted to
    inputs). ``buffer_ids`` are ``id()`` of the model's buffers, used to fill ``Captured.constants``.
    ``sizes_seen``: these sizes were captured before, so symbolic sizes come from another change (dynamo
    makes a tensor's sizes symbolic when only its strides changed): they are pinned, and the graph keeps
    every rewrite a static graph gets.
    """
    # Trace under dynamo's own fake mode (as aot_autograd does): a second fake mode would create
    # symbols that dynamo's shape env cannot guard on. Where dynamo made a size dynamic (it changed
    # between calls), trace with dynamo's own symbolic example values: one graph for every length.
    # (a shape env of its own elsewhere: a data-dependent size, ``torch.where``'s, becomes a symbol)
    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(shape_env=ShapeEnv())
    fake_inputs = _fake_inputs(fake_mode, gm, example_inputs)
    dynamic = not sizes_seen and any(_symbolic(v) for v in fake_inputs)
    if not dynamic:
        _pin_symbolic_sizes(gm)
    # fake-tensor caching costs more than it saves where sizes are data-dependent (a 64-expert loop lowers
    # 25% faster without it); elsewhere it pays (repeated layers)
    uncached = _uncached(fake_mode) if data_dependent(gm) else contextlib.nullcontext()
    if any(getattr(n.target, "__module__", "") == "torch._functorch.predispatch" for n in gm.graph.nodes):
        raise RuntimeError("torch.func.vmap inside the captured code (torch's generic associative_scan uses it): "
                           "the pre-dispatch trace cannot follow it")
    with fx_traceback.preserve_node_meta(), fake_mode, uncached:
        aten = make_fx(fx.Interpreter(gm).run, pre_dispatch=True)(*fake_inputs)
    _no_traced_constants(aten)
    split_size_calls(aten)
    device_scalars(aten, fake_mode)
    _keep_input_metadata(aten, gm)
    _source_names(aten, gm)
    constants = ReadTracking()
    placeholders = [n for n in aten.graph.nodes if n.op == "placeholder"]
    positions = {}
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if buffer_ids and isinstance(value, torch.Tensor) and id(value) in buffer_ids \
                and not isinstance(value, torch._subclasses.FakeTensor):
            constants[node.name], positions[node.name] = value, i
    requires_grad = [bool(getattr(v, "requires_grad", False)) for v in example_inputs]
    return Captured(aten, constants, requires_grad, positions, dynamic=dynamic)


def _no_traced_constants(aten: fx.GraphModule) -> None:
    """Raise where the trace kept a fake tensor as a constant: a value that escaped the tracer (as a
    ``torch.func.vmap`` inside the captured code did: HF Mamba's scan under dynamo, through torch's generic
    ``associative_scan``) would be baked in, and the graph fail at run time or compute with stale values."""
    fakes = [n.target for n in aten.graph.find_nodes(op="get_attr")
             if isinstance(getattr(aten, n.target, None), torch._subclasses.FakeTensor)]
    if fakes:
        raise RuntimeError(f"the trace kept {len(fakes)} traced value(s) as constants ({fakes[0]}, ...): "
                           "code the lowering cannot follow")


def _keep_input_metadata(aten: fx.GraphModule, dynamo_gm: fx.GraphModule) -> None:
    """Record on each lowered input what dynamo knew of it: its source and whether it is *static* (a
    parameter or buffer: same address every call), as ``meta["dynamo_input"]``. ``static_inputs``
    hands it to AOTAutograd, which reads it only from graphs dynamo made; without it every input is
    taken for an activation, and a CUDA-graph replay copies each parameter into the graph's own
    buffers first (host time and one copy of the weights per step)."""
    compile_id = dynamo_gm.meta.get("dynamo_compile_id")
    old = dynamo_gm.graph.find_nodes(op="placeholder")
    new = aten.graph.find_nodes(op="placeholder")
    if compile_id is None or len(old) != len(new):
        return
    for n, o in zip(new, old):
        static = (o.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type")
        n.meta["dynamo_input"] = (getattr(o, "_dynamo_source", None), static, compile_id)


def static_inputs(gm: fx.GraphModule) -> bool:
    """Make ``gm`` carry dynamo's input metadata (``_keep_input_metadata``) where AOTAutograd reads it
    (``_try_get_metadata_from_dynamo``: the module's compile id, ``_param_name_to_source``, each
    placeholder's ``_dynamo_source`` and static-input type). False, and ``gm`` untouched, when an input
    lacks it or ``gm`` holds registered parameters or buffers (which AOTAutograd would look up by source),
    other than the tensor constants tracing made (``_tensor_constant0``: HF's cache builds ``torch.tensor([])``
    in every LLaMA-family forward); those get a source of their own."""
    from torch._dynamo.source import ConstantSource
    inputs = [n.meta.get("dynamo_input") for n in gm.graph.find_nodes(op="placeholder")]
    owned = [name for name, _ in gm.named_buffers()]
    if not inputs or any(i is None for i in inputs) or next(gm.named_parameters(), None) is not None \
            or not all(re.fullmatch(r"_tensor_constant\d+", name) for name in owned):
        return False
    seen = set()
    for node, (source, static, _) in zip(gm.graph.find_nodes(op="placeholder"), inputs):
        node._dynamo_source = source if source not in seen else None
        seen.add(source)
        if static:
            node.meta.setdefault("tensor_dict", {})["_dynamo_static_input_type"] = static
    gm.meta["dynamo_compile_id"] = inputs[0][2]
    gm._param_name_to_source = {name: ConstantSource(f"opsmath_{id(gm)}_{name}") for name in owned}
    return True


def _source_names(aten: fx.GraphModule, dynamo_gm: fx.GraphModule) -> None:
    """Name the lowered graph's inputs after their source, as dynamo recorded it, instead of
    ``arg7_1``: ``l_model_modules_h_modules_0_modules_attn_parameters_weight_`` becomes
    ``h_0_attn_weight``, so the report's snippets read like the model."""
    sources = [n.name for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
    lowered = [n for n in aten.graph.nodes if n.op == "placeholder"]
    if len(sources) != len(lowered):
        return
    for node, src in zip(lowered, sources):
        name = re.sub(r"^[lL]_(self_|model_)?", "", src)
        name = re.sub(r"(^|_)(modules|parameters|buffers)_", r"\1", name).strip("_")
        if name.isidentifier():
            node._rename(name)
    aten.recompile()


def split_size_calls(gm: fx.GraphModule) -> None:
    """Rewrite ``aten.size.default(x)`` (all of a tensor's sizes at once, as some torch versions'
    pre-dispatch traces record ``x.size()``) into one ``aten.sym_size.int(x, i)`` per dimension.

    Why: fake-tensor propagation handles ``aten.size.default`` by converting every size to ``int``,
    which on a symbolic graph guards each size to its current value, so dynamo recompiles for every
    new length. ``sym_size.int`` keeps a size symbolic. ``getitem(size, i)`` users take the i-th
    node; any other user gets the list of per-dimension nodes in place of the tuple.
    """
    graph = gm.graph
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.size.default)):
        val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        with graph.inserting_after(node):
            dims = [graph.call_function(torch.ops.aten.sym_size.int, (node.args[0], i))
                    for i in reversed(range(val.dim()))][::-1]
        for d, size in zip(dims, val.shape):
            d.meta["val"] = size
        for user in list(node.users):
            if user.target is operator.getitem and isinstance(user.args[1], int):
                user.replace_all_uses_with(dims[user.args[1]])
                graph.erase_node(user)
            else:
                swap = lambda a: list(dims) if a is node else a  # noqa: E731
                user.args, user.kwargs = fx.node.map_aggregate(user.args, swap), \
                    fx.node.map_aggregate(user.kwargs, swap)
        graph.erase_node(node)
        for d in dims:
            if not d.users:
                graph.erase_node(d)
    gm.recompile()


@contextlib.contextmanager
def _uncached(fake_mode):
    """``fake_mode`` without its dispatch cache (``FakeTensorMode.cache_enabled``, in every torch opsmath
    supports; torch's own context manager for it is recent)."""
    old = fake_mode.cache_enabled
    fake_mode.cache_enabled = False
    try:
        yield
    finally:
        fake_mode.cache_enabled = old


def data_dependent(gm: fx.GraphModule, key: str = "example_value") -> bool:
    """Whether a graph has a data-dependent (unbacked) size (``torch.where``, ``nonzero``), read from each
    node's ``meta[key]``: dynamo's ``example_value``, a lowered graph's ``val``."""
    return any(free_unbacked_symbols(n.meta.get(key)) for n in gm.graph.nodes)


def _symbolic(v) -> bool:
    return isinstance(v, torch.SymInt) or isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt)
                                                                              for s in v.shape)


def _pin_symbolic_sizes(gm: fx.GraphModule) -> None:
    """Where dynamo's graph has symbolic sizes but the trace is static (no symbolic context found for
    its inputs), pin each symbol to its value with a guard (``int()`` of a SymInt guards on it in
    dynamo's shape env): dynamo then recompiles for other values instead of running a graph whose
    sizes are baked in."""
    for n in gm.graph.nodes:
        v = n.meta.get("example_value") if n.op == "placeholder" else None
        sizes = [v] if isinstance(v, torch.SymInt) else list(v.shape) if isinstance(v, torch.Tensor) else []
        for s in sizes:
            if isinstance(s, torch.SymInt):
                int(s)


def _fake_inputs(fake_mode, gm: fx.GraphModule, example_inputs: list) -> list:
    """Fake versions of a backend's real inputs, as AOTAutograd makes them: each tensor with the
    symbolic context dynamo recorded for it (sizes dynamo made dynamic stay symbols of its shape env;
    the others static), a size argument as dynamo's SymInt. Outside a dynamo compile (a piece of a
    split graph compiled at its first call) everything is static."""
    ctx = torch._guards.TracingContext.try_get()
    known = getattr(ctx, "tensor_to_context", None) if ctx is not None else None
    examples = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            sc = known.get(x) if known is not None and not isinstance(x, torch._subclasses.FakeTensor) else None
            out.append(fake_mode.from_tensor(x, static_shapes=sc is None, symbolic_context=sc,
                                             source=getattr(sc, "tensor_source", None)))
        elif isinstance(x, int) and known is not None and i < len(examples) and isinstance(examples[i], torch.SymInt):
            out.append(examples[i])
        else:
            out.append(x)
    return out
