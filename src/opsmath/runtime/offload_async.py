"""Where the offloaded activations' copies go in Inductor's forward and backward graphs, so that they run
beside the compute instead of in front of it (the ops: ``offload_ops.py``).

The plan marks the nodes whose saved outputs go to the host (``offload.OFFLOAD``). After AOTAutograd's
partitioner has chosen what the forward saves, ``place`` rewrites both graphs:

- **Forward.** Each marked saved tensor ``x`` of ``b`` bytes is copied out right after its last forward
  use (``offload_start``) and the forward saves the host copy instead. The copies queue on one transfer
  stream; copy k ends at ``e_k = max(s_k, e_{k-1}) + m * b_k / link`` (``m``: ``offload.margin()``), where
  ``s_k`` is the modelled time (``segments.node_cost`` summed along the graph) at its start. Its ``offload_wait`` goes before the
  first node whose modelled time reaches ``e_k``: the compute stream waits for a copy only once the
  compute since its start should have covered it, and ``x`` is freed there. A copy that cannot end before
  the forward does is waited for at once (``Placed.late`` counts it): ``x`` is freed where the plan
  counts it, and the copy is on the critical path, as the plan priced it (``offload.late``).
- **Backward.** The reloads (``reload_start``) queue on the same transfer stream, so they are scheduled
  latest use first: each copy of ``m * b / link`` modelled seconds ends before its first use and
  before the next copy in the queue starts, and is issued after the last node ending by then. A reload
  moves earlier than its copy alone would need only while the bytes it then holds keep the graph's
  modelled live bytes under the graph's own peak (``_reload_anchors``). Each is waited for
  (``reload_wait``) just before its first use. (Scheduled one by one, the reloads of a LLaMA step bunched
  in its last 30 ms and the compute stream waited 11.7 ms on them: ``results/profile_offload-llama-h100-*``.)

Modelled times come from the plan's cost model (GEMM FLOPs, bytes moved), so the margin covers its error
and the transfer stream's queueing in backward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._prims_common import make_contiguous_strides_for

from opsmath.runtime import offload_ops   # (importing it registers the ops)
from opsmath.capture.frames import source_location
from opsmath.memory import offload
from opsmath.memory.offload import _marked, margin
from opsmath.memory.weight_casts import is_view, narrowing
from opsmath.memory.segments import _nbytes, node_cost

placements: list = []   # every Placed of this process, in compile order (the report and benchmarks read it)
ops = torch.ops.opsmath


@dataclass
class Placed:
    """What ``place`` did to one forward/backward pair."""
    names: list = field(default_factory=list)   # the saved tensors sent to the host
    nbytes: int = 0
    late_tensors: list = field(default_factory=list)   # of them, copies the forward cannot cover (waited
    # for at once), as "name shape dtype <- file:line: code"
    input_casts: int = 0   # of them, low-precision copies of a graph input (under autocast: the weights'
    # copies, or an activation an earlier graph handed in)

    @property
    def late(self) -> int:
        return len(self.late_tensors)


def _eligible(x, users_out: bool) -> bool:
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    return (isinstance(v, torch.Tensor) and x.op == "call_function" and _marked(x) and not users_out
            and _base(x).op != "placeholder" and all(isinstance(d, int) for d in (*v.shape, *v.stride())))


def _base(x: fx.Node) -> fx.Node:
    """The node whose memory ``x`` views (``x`` itself when it is not a view). A view of a graph input (a
    weight's transpose saved for backward) frees nothing when sent: the input stays."""
    while x.op == "call_function" and getattr(x.target, "is_view", False) and x.args and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    return x


def _input_cast(x: fx.Node) -> bool:
    """``x`` is (a view of) a narrowing cast of (a view of) a graph input: a weight's bf16 copy."""
    b = _base(x)
    return narrowing(b) and _base(b.args[0]).op == "placeholder"


def _ends(order: list[fx.Node]) -> dict[fx.Node, float]:
    """Modelled time at each node's end, from the graph's start."""
    t, out = 0.0, {}
    for n in order:
        t += node_cost(n)
        out[n] = t
    return out


def _fake(v: torch.Tensor, device, size=None, stride=None) -> torch.Tensor:
    from torch._guards import detect_fake_mode
    mode = detect_fake_mode([v])
    with mode if mode is not None else contextlib.nullcontext():
        return torch.empty_strided(size or v.shape, stride or make_contiguous_strides_for(v.shape), dtype=v.dtype,
                                   device=device)


def _set_val(n: fx.Node, v) -> None:
    from torch.fx.passes.shape_prop import _extract_tensor_metadata
    n.meta["val"] = v
    if isinstance(v, torch.Tensor):
        n.meta["tensor_meta"] = _extract_tensor_metadata(v)


def offload_forward(fw: fx.GraphModule, num_fwd_outputs: int, link: float) -> tuple[Placed, dict]:
    """The forward half of ``place``: returns what it sent and, by saved name, (size, stride, device)."""
    graph, placed, layouts = fw.graph, Placed(), {}
    out = graph.find_nodes(op="output")[0]
    outs = list(out.args[0])
    order = list(graph.nodes)
    pos, ends = {n: i for i, n in enumerate(order)}, _ends(order)
    user_outs = set(outs[:num_fwd_outputs])
    todo = []
    for k in range(num_fwd_outputs, len(outs)):
        x = outs[k]
        if _eligible(x, x in user_outs) and x.name not in layouts:
            users = [u for u in x.users if u is not out]
            todo.append((pos[max(users, key=pos.get)] if users else pos[x], k, x))
            layouts[x.name] = None
    busy, swap, m = 0.0, {}, margin()
    for last, k, x in sorted(todo, key=lambda r: r[0]):
        v = x.meta["val"]
        with graph.inserting_after(order[last]):
            h = graph.call_function(ops.offload_start.default, (x,))
        _set_val(h, _fake(v, "cpu"))
        start = max(ends[order[last]], busy)
        covered = start + m * _nbytes(x) / link
        at = next((n for n in order[last + 1:] if ends[n] >= covered and n is not out), None)
        late = at is None
        if late:   # waited for at once, so x is freed where the plan counts it
            busy, at = start, h.next
        else:
            busy = covered
        with graph.inserting_before(at):
            graph.call_function(ops.offload_wait.default, (h, x))
        swap[x] = h
        layouts[x.name] = (list(v.shape), list(v.stride()), v.device)
        placed.names.append(x.name)
        placed.nbytes += _nbytes(x)
        placed.input_casts += _input_cast(x)
        if late:
            loc, code = source_location(x)
            placed.late_tensors.append(f"{x.name} {tuple(v.shape)} {v.dtype} <- {loc}: {code.strip()}")
    out.update_arg(0, tuple(swap.get(n, n) if i >= num_fwd_outputs else n for i, n in enumerate(outs)))
    graph.lint()
    fw.recompile()
    return placed, {k: v for k, v in layouts.items() if v is not None}


def _live_bytes(order: list[fx.Node], pos: dict, host: set) -> list[int]:
    """Modelled device bytes alive at each node of a backward graph: each non-view device output from its
    node (a placeholder: from the start) through its last reader; ``host``: placeholders that are not."""
    last = {}
    for n in order:
        for x in n.all_input_nodes:
            last[x] = pos[n]
    delta = [0] * (len(order) + 1)
    for n in order:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.device.type == "cpu" or is_view(n) or n in host:
            continue
        delta[0 if n.op == "placeholder" else pos[n]] += _nbytes(n)
        delta[last.get(n, pos[n]) + 1] -= _nbytes(n)
    live, out = 0, []
    for d in delta[:-1]:
        live += d
        out.append(live)
    return out


def _reload_anchors(order: list[fx.Node], pos: dict, loads: list) -> dict:
    """Where each reload is issued: ``loads`` holds ``(p, use, alap, own, nbytes)``, ``alap`` the anchor
    position that lets the copies, queued one after another on the transfer stream, end before their uses,
    and ``own`` the position one copy alone would need. A reload moves from ``own`` towards ``alap`` only
    while the bytes it holds early keep the graph's modelled live bytes (``_live_bytes``, every reload counted
    from its use) under their own peak; it never moves later than ``own``. Latest use first."""
    live = _live_bytes(order, pos, {r[0] for r in loads})
    for p, use, _, _, b in loads:          # each reloaded tensor is device memory from its use to its last
        for k in range(pos[use], max(pos[u] for u in p.users) + 1):
            live[k] += b
    peak, anchors = max(live, default=0), {}
    for p, use, alap, own, b in sorted(loads, key=lambda r: -pos[r[1]]):
        j = own
        while j > alap and j > 0 and live[j] + b <= peak:   # holding the copy from node j on stays under
            j -= 1
        anchors[p] = j
        for k in range(j + 1, pos[use]):
            live[k] += b
    return anchors


def reload_backward(bw: fx.GraphModule, layouts: dict, link: float) -> None:
    """The backward half of ``place``: each offloaded input reloaded ahead of its first use, the reloads
    scheduled latest-first against the transfer stream's queue within the graph's own memory peak
    (``_reload_anchors``)."""
    graph = bw.graph
    order = list(graph.nodes)
    pos, ends = {n: i for i, n in enumerate(order)}, _ends(order)
    first_op = next(n for n in order if n.op != "placeholder")
    ops_before = [i for i, n in enumerate(order) if n.op != "placeholder"]

    def anchor_at(t: float, use: fx.Node) -> int:   # the last op ending by modelled time t (-1: none)
        return max((i for i in ops_before if i < pos[use] and ends[order[i]] <= t), default=-1)
    loads, free, m = [], float("inf"), margin()
    for p in sorted((n for n in order if n.op == "placeholder" and n.name in layouts and n.users),
                    key=lambda n: -min(pos[u] for u in n.users)):
        use = min(p.users, key=pos.get)
        need, copy = ends[use] - node_cost(use), m * _nbytes(p) / link
        free = min(need, free) - copy        # the queue: this copy ends before the next one starts
        loads.append((p, use, anchor_at(free, use), anchor_at(need - copy, use), _nbytes(p)))
    anchors = _reload_anchors(order, pos, loads)
    for p in [n for n in order if n.op == "placeholder" and n.name in layouts]:
        size, stride, device = layouts[p.name]
        v = p.meta["val"]
        _set_val(p, _fake(v, "cpu", list(v.shape)))
        if not p.users:
            continue
        use = min(p.users, key=pos.get)
        anchor = order[anchors[p]] if anchors[p] >= 0 else None
        after = anchor if anchor is not None and isinstance(anchor.meta.get("val"), torch.Tensor) else p
        with graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(first_op):
            y = graph.call_function(ops.reload_start.default, (p, after, size, stride, device))
        _set_val(y, _fake(v, device, size, stride))
        with graph.inserting_before(use):
            graph.call_function(ops.reload_wait.default, (y,))
        for u in list(p.users):
            if u is not y:
                u.replace_input_with(p, y)
    graph.lint()
    bw.recompile()


def place(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, link: float) -> Placed:
    """Rewrite a partitioned forward/backward pair (module docstring); returns what went to the host."""
    placed, layouts = offload_forward(fw, num_fwd_outputs, link)
    if layouts:
        reload_backward(bw, layouts, link)
    return placed


@contextlib.contextmanager
def partitioned_with_offload(link: float):
    """Inside, Inductor's partition of a joint graph is followed by ``place`` (``placements`` gets each)."""
    import torch._inductor.compile_fx as cfx
    original = cfx.min_cut_rematerialization_partition

    def partition(joint, inputs, *args, **kwargs):
        fw, bw = original(joint, inputs, *args, **kwargs)
        placements.append(place(fw, bw, kwargs["num_fwd_outputs"], link))
        return fw, bw

    cfx.min_cut_rematerialization_partition = partition
    try:
        yield
    finally:
        cfx.min_cut_rematerialization_partition = original


def offloading(gm: fx.GraphModule, example_inputs):
    """The context to compile ``gm`` in: when it has offloaded nodes, Inductor's partition followed by
    ``place`` over this machine's link, Inductor's peak-memory reordering off (it would move the waits and
    reloads the placement chose), ``offload_start``'s lowering registered (``offload_ops.lowerings``) and
    Inductor's graph cache off (its key does not see that lowering); else a null context."""
    if not offload.has_offload(gm):
        return contextlib.nullcontext()
    offload_ops.lowerings()
    # off CUDA (tests) the copies are plain copies, and any link places them
    link = offload.link_for(example_inputs, "tag") or 55e9
    stack = contextlib.ExitStack()
    stack.enter_context(partitioned_with_offload(link))
    stack.enter_context(torch._inductor.config.patch(reorder_for_peak_memory=False, fx_graph_cache=False))
    return stack
