"""Changing sequence lengths: after the second length a size becomes symbolic (as under torch.compile)
and one rewritten graph serves every later length; nothing runs unoptimized behind the user's back,
and training equals eager at every length."""
import copy

import pytest
import torch

import opsmath
from opsmath import examples
from conftest import DEVICE
from tolerance import grads_close, rel_err

LENGTHS = [8, 12, 16, 20, 24, 28, 30, 10, 14, 9, 31, 8]


def _train_all_lengths(model, eager, make_batch, **options):
    opt = opsmath.optimize(model, **options)
    for T in LENGTHS:
        batch = make_batch(T)
        loss, loss_e = opt(*batch[0], **batch[1]), eager(*batch[0], **batch[1])
        loss, loss_e = getattr(loss, "loss", loss), getattr(loss_e, "loss", loss_e)
        loss.backward()
        loss_e.backward()
        assert rel_err(loss, loss_e) < 1e-5, T
        for (name, p), pe in zip(opt.named_parameters(), eager.parameters()):
            if pe.grad is not None:
                assert grads_close(p.grad, pe.grad, 2e-3, atol=1e-6), (T, name)
        opt.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    return opsmath.report(opt)


def test_hf_llama_sdpa_one_dynamic_graph_for_every_length():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg).to(DEVICE)

    def batch(T):
        ids = torch.randint(0, 100, (2, T), device=DEVICE)
        return (), dict(input_ids=ids, labels=ids)
    rep = _train_all_lengths(model, copy.deepcopy(model), batch)
    assert [g.dynamic for g in rep.graphs] == [False, True], [(g.dynamic, g.calls, g.input_shapes) for g in rep.graphs]
    assert rep.graphs[1].calls == len(LENGTHS) - 1
    assert all(sum(m.pattern == "attention" for m in g.matches) == 2 for g in rep.graphs)
    assert rep.unoptimized_calls == 0
    assert "dynamic" in str(rep)


def test_nanogpt_constant_mask_and_every_length():
    torch.manual_seed(0)
    model, (idx, tgt) = examples.gpt(batch_size=2, seq_len=32, dropout=0.0)
    rep = _train_all_lengths(model, copy.deepcopy(model), lambda T: ((idx[:, :T].contiguous(), tgt[:, :T].contiguous()), {}))
    assert len(rep.graphs) == 2 and rep.graphs[1].dynamic and rep.unoptimized_calls == 0
    assert sum(m.pattern == "attention" for m in rep.graphs[1].matches) == 2


@pytest.mark.slow
def test_memory_budget_plans_every_length_exactly():
    """Under a memory budget each length gets its own, exactly planned graph (up to opsmath's
    recompile limit, past dynamo's default of 8), none unoptimized."""
    torch.manual_seed(0)
    model, (idx, tgt) = examples.gpt(batch_size=2, seq_len=32, dropout=0.0)
    rep = _train_all_lengths(model, copy.deepcopy(model), lambda T: ((idx[:, :T].contiguous(), tgt[:, :T].contiguous()), {}),
                             memory_budget=0.9)
    assert len(rep.graphs) == len(set(LENGTHS)) and not any(g.dynamic for g in rep.graphs)
    assert rep.unoptimized_calls == 0


def test_size_calls_stay_symbolic_through_fake_propagation():
    """``aten.size.default`` (how some torch versions trace ``x.size()``) becomes per-dimension
    ``sym_size.int``: fake propagation of the rewritten graph must not pin a length to its value,
    or dynamo recompiles for every new length."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from opsmath.capture.lower import split_size_calls

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    size = graph.call_function(torch.ops.aten.size.default, (x,))
    t = graph.call_function(__import__("operator").getitem, (size, 1))
    flat = graph.call_function(torch.ops.aten.view.default, (x, [-1, t]))
    same = graph.call_function(torch.ops.aten.view.default, (flat, size))
    graph.output((same,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fake = mode.from_tensor(torch.randn(2, 7, 3), static_shapes=False)
    x.meta["val"] = fake
    split_size_calls(gm)
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.size.default)
    out, = FakeTensorProp(gm, mode).propagate_dont_convert_inputs(fake)
    assert not mode.shape_env.replacements, mode.shape_env.replacements
    assert [str(s) for s in out.shape] == [str(s) for s in fake.shape]
    real = torch.randn(3, 5, 2)
    assert torch.equal(gm(real)[0], real)


def test_size_calls_on_nodes_without_metadata_stay_symbolic():
    """A size call whose input has no ``meta["val"]`` (a node a rewrite inserted) cannot be split
    ahead of time; the propagation itself must keep it symbolic."""
    import operator
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from opsmath.capture.lower import split_size_calls
    from opsmath.rewrite.match import SymbolicSizeProp

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    size = graph.call_function(torch.ops.aten.size.default, (y,))
    t = graph.call_function(operator.getitem, (size, 1))
    graph.output((graph.call_function(torch.ops.aten.view.default, (y, [-1, t])),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fake = mode.from_tensor(torch.randn(2, 7), static_shapes=False)
    out, = SymbolicSizeProp(gm, mode).propagate_dont_convert_inputs(fake)
    assert not mode.shape_env.replacements, mode.shape_env.replacements
    assert str(out.shape[1]) == str(fake.shape[1])
    split_size_calls(gm)   # with the values propagation gave, the call splits for the next tracer
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.size.default)


def test_propagation_after_rewrite_does_not_rerun_traced_nodes():
    """Nodes that already carry a fake value keep it: re-running them outside their tracer can guard a
    symbolic length to its value (on CUDA a C++ kernel reading non-symbolic ``sizes()`` of a fake tensor
    did, so every new length recompiled). Only nodes without a value are computed."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from opsmath.rewrite.match import SymbolicSizeProp

    calls = []

    def pins_its_length(t):   # stands in for a kernel that reads concrete sizes
        calls.append(int(t.shape[0]))
        return t * 2

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    traced = graph.call_function(pins_its_length, (x,))
    inserted = graph.call_function(torch.ops.aten.add.Tensor, (traced, 1.0))
    graph.output((inserted,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fake = mode.from_tensor(torch.randn(5, 3), static_shapes=False)
    x.meta["val"] = fake
    with mode:
        traced.meta["val"] = fake * 2
    out, = SymbolicSizeProp(gm, mode).propagate_dont_convert_inputs(fake)
    assert calls == [] and not mode.shape_env.replacements, (calls, mode.shape_env.replacements)
    assert str(out.shape[0]) == str(fake.shape[0]) and "val" in inserted.meta


class _IndexMaskAttention(torch.nn.Module):
    """SDPA with the causal mask spelled as Hugging Face builds it under dynamic shapes: a comparison of
    ``arange(T)`` tensors, which cannot be evaluated to a constant when T is a symbol."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, 4, 8).transpose(1, 2) for t in self.qkv(x).split(32, -1))
        keep = torch.arange(T)[None, None, None, :] <= torch.arange(T)[None, None, :, None]
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep.expand(B, -1, T, T))
        return y.sum()


def test_index_mask_of_symbolic_length_is_read_as_causal():
    torch.manual_seed(0)
    model = _IndexMaskAttention()
    ref = copy.deepcopy(model)
    opt = opsmath.optimize(model, inductor=False)
    for T in (8, 11, 17):
        x = torch.randn(2, T, 32)
        a, b = opt(x), ref(x)
        a.backward()
        b.backward()
        assert rel_err(a, b) < 1e-5
    dyn = [g for g in opsmath.report(opt).graphs if g.dynamic]
    assert dyn and dyn[0].calls == 2
    details = [m.details for m in dyn[0].matches if m.pattern == "attention"]
    assert details and details[0]["causal"] and not details[0]["has_mask"], details
    for p, r in zip(model.parameters(), ref.parameters()):
        assert grads_close(p.grad, r.grad, rtol=1e-4)


def test_size_argument_of_a_piece_compiled_outside_dynamo_is_its_value():
    """A piece of a split graph compiled at its first call (no dynamo tracing context) is traced static:
    its size argument must be the int it was called with, not dynamo's symbol (whose hint is the length
    dynamo first saw; HF BLOOM failed to lower at the third length)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from opsmath.capture.lower import _fake_inputs

    mode = FakeTensorMode(shape_env=ShapeEnv())
    sym = mode.from_tensor(torch.randn(28), static_shapes=False).shape[0]
    graph = torch.fx.Graph()
    x, n = graph.placeholder("x"), graph.placeholder("n")
    n.meta["example_value"] = sym
    graph.output((graph.call_function(torch.ops.aten.view.default, (x, [2, n])),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    fake_x, size = _fake_inputs(FakeTensorMode(), gm, [torch.randn(72), 36])
    assert size == 36 and isinstance(size, int) and tuple(fake_x.shape) == (72,)


def test_hf_eager_additive_causal_mask_of_symbolic_length_is_causal():
    """HF's eager attention adds ``where(causal, 0, finfo.min)``; on the dynamic graph that bias is no
    constant, yet it is read as causal at every length (block skipping, no S x S bias)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).train()
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    for T in (12, 16, 20):
        ids = torch.randint(0, 64, (2, T))
        loss, loss_e = opt(input_ids=ids, labels=ids).loss, eager(input_ids=ids, labels=ids).loss
        assert abs(loss.item() - loss_e.item()) <= 1e-5 * abs(loss_e.item())
    dyn = [g for g in opsmath.report(opt).graphs if g.dynamic]
    assert dyn and dyn[0].calls == 2
    attn = [m.details for m in dyn[0].matches if m.pattern == "attention"]
    assert len(attn) == 2 and all(d["causal"] and not d["has_bias"] for d in attn), attn


def test_a_stride_only_change_keeps_every_rewrite():
    """Column-major input of the same sizes: dynamo recaptures with symbolic sizes; opsmath pins them
    (the sizes were seen), so the graph is static and keeps every rewrite."""
    import opsmath
    from opsmath.examples import gpt
    torch.manual_seed(0)
    model, (x, y) = gpt(batch_size=2, seq_len=16, dropout=0.0)
    opt = opsmath.optimize(model)
    opt(x, y).backward()
    opt(x.t().contiguous().t(), y).backward()
    first, second = opsmath.report(opt).graphs
    assert not second.dynamic and len(second.matches) == len(first.matches) == 9
