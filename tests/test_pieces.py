"""Graphs split around regions left to eager (``src/opsmath/capture/regions.py``): the pieces between an
``autograd.Function`` train like eager and still see what their rewrites need (HF's causal mask, ALiBi)."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn as nn

import opsmath
from semantics_idioms import GradReverse
from test_inductor import step_equals_eager
from test_semantics import MODES, assert_trains_like_eager


def _bloom(n_layer: int):
    """A tiny HF BLOOM (GeLU as an ``autograd.Function`` in every MLP) and three batches, as ``make``."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BloomConfig(n_layer=n_layer, hidden_size=32, n_head=4, vocab_size=100,
                                   attn_implementation="eager", hidden_dropout=0.0, attention_dropout=0.0)

    def make():
        ids = [torch.randint(0, 100, (2, 12)) for _ in range(3)]
        return transformers.BloomForCausalLM(cfg), [dict(input_ids=i, labels=i) for i in ids]
    return make


def test_bloom_gelu_function_keeps_every_gradient():
    """BLOOM's MLP activation is an ``autograd.Function``: every gradient present and equal, the region
    reported as left to eager."""
    optimized = assert_trains_like_eager(_bloom(2), patterns=None, mode=MODES[True], kwargs=True)
    regions = opsmath.report(optimized).eager_regions
    assert sum(r.kind == "autograd.Function" for r in regions) == 2, regions


def test_pieces_after_a_function_recompute_the_causal_mask_and_alibi():
    """BLOOM's Function splits its graph; the pieces after it recompute HF's causal mask and ALiBi from
    sizes instead of receiving them, so every layer's attention is causal with a per-key bias (not a
    materialized (B, H, S, S) one), and training stays equal to eager."""
    optimized = assert_trains_like_eager(_bloom(3), patterns=None, mode=MODES[True], kwargs=True)
    attn = [m for m in opsmath.report(optimized).matches if m.pattern == "attention"]
    assert len(attn) == 3 and all(m.details["causal"] and m.details["has_bias"] for m in attn), attn
    assert all("bias(8, 1, 12)" in m.replacement for m in attn), [m.replacement for m in attn]   # B*H, 1, S


class _MaskedBlocks(nn.Module):
    """Two attention layers with a Function between them, the causal mask built as transformers 5.17
    builds BLOOM's: ``ones`` as the attention mask, ``causal & padding`` through ``operator.and_``."""
    def __init__(self, d=32, h=4):
        super().__init__()
        self.h, self.qkv, self.out = h, nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(2)), nn.Linear(d, d)

    def forward(self, x):
        B, S, D = x.shape
        keep = torch.ones(B, S, device=x.device)
        i = torch.arange(S, device=x.device)
        allowed = (i[None, None, :, None] >= i[None, None, None, :]) & (keep[:, None, None, :] > 0)
        mask = torch.where(allowed, 0.0, torch.finfo(x.dtype).min).to(x.dtype)   # bf16 on the GPU run
        for n, qkv in enumerate(self.qkv):
            q, k, v = qkv(x).view(B, S, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
            p = torch.softmax(q @ k.transpose(-1, -2) * (D // self.h) ** -0.5 + mask, -1)
            x = x + (p @ v).transpose(1, 2).reshape(B, S, D)
            x = GradReverse.apply(x, 0.5) if n == 0 else x
        return self.out(x)


def test_pieces_after_a_function_copy_a_mask_built_with_operator_and():
    """``operator.and_`` is out of place: the mask chain is copied into the piece after the Function,
    whose attention is then causal too (before, only the first piece's was)."""
    optimized = assert_trains_like_eager(lambda: (_MaskedBlocks(), [(torch.randn(2, 12, 32),) for _ in range(3)]),
                                         patterns=None, mode=MODES[True])
    attn = [m for m in opsmath.report(optimized).matches if m.pattern == "attention"]
    assert len(attn) == 2 and all(m.details["causal"] and not m.details["has_bias"] for m in attn), attn


def test_checkpoint_bodies_stop_compiling_when_sizes_keep_changing(monkeypatch):
    """A checkpoint body kept as written compiles once per input size up to ``PIECE_SIZES``; then it
    runs as traced, training stays equal to eager, and the report says so once."""
    import copy
    from idioms_base import Checkpointed
    from opsmath.capture import pieces
    monkeypatch.setattr(pieces, "PIECE_SIZES", 2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Checkpointed(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))))
    eager = copy.deepcopy(model)
    optimized = opsmath.optimize(model, inductor=False)
    for rows in (3, 4, 5, 6, 7):
        x = torch.randn(rows, 8)
        optimized(x).square().sum().backward()
        eager(x).square().sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    notes = [e for e in opsmath.report(optimized).fallback_errors if e.startswith("a checkpoint body")]
    assert len(notes) == 1 and "more than 2 input sizes" in notes[0], opsmath.report(optimized).fallback_errors


def test_bloom_pieces_keep_attention_rewritten_across_lengths():
    """BLOOM's pieces (split by its GeLU Function) met with a new length each step: after the first sizes
    they compile once with symbolic sizes, and those pieces still get the causal ALiBi attention rewrite
    (the causal mask's index chain is copied into them with symbolic sizes); gradients equal eager's."""
    model = _bloom(2)()[0].train()
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model, inductor=False)
    for T in (8, 12, 16, 20, 31):
        ids = torch.randint(0, 100, (2, T))
        opt(input_ids=ids, labels=ids).loss.backward()
        eager(input_ids=ids, labels=ids).loss.backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    rep = opsmath.report(opt)
    symbolic = [g for g in rep.graphs if g.dynamic]
    # 3 pieces at the first length, the same again at the second where dynamo still specializes
    # (torch 2.13; 2.11 goes symbolic at the second length), then 3 with symbolic sizes
    assert len(symbolic) == 3 and len(rep.graphs) - 3 in (3, 6), [g.input_shapes for g in rep.graphs]
    attention = [m for g in symbolic for m in g.matches if m.pattern == "attention"]
    assert len(attention) == 2 and all(m.details["causal"] and m.details["has_bias"] for m in attention)
    assert not rep.fallback_errors


def test_a_piece_of_fixed_sizes_reads_no_key_after_its_compile():
    """A piece cut from a graph whose every size dynamo traced as a constant meets the one size the
    parent's guards admit: after its one compile it calls it without reading its inputs' sizes (host time
    on every step). A graph with a symbolic size keeps reading them."""
    from opsmath.capture.pieces import LazyPiece, fixed_sizes
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x):
        return (x * 2).sum(0)
    torch.compile(f, backend=capture)(torch.randn(3, 4))
    torch.compile(f, backend=capture, dynamic=True)(torch.randn(5, 4))
    static, dynamic = graphs
    assert fixed_sizes(static) and not fixed_sizes(dynamic)
    compiles = []
    piece = LazyPiece(static, lambda gm, args: (compiles.append(1), gm.forward)[1])
    x = torch.randn(3, 4)
    piece(x)
    piece._key = None   # any read of the sizes now raises
    torch.testing.assert_close(piece(x)[0], (x * 2).sum(0))
    assert compiles == [1]


class Annealed(nn.Module):
    """A float attribute (a temperature, a norm's eps) read on both sides of an autograd Function: after
    dynamo's recompile for a second value it is a 0-dim tensor the graph reads with ``.item()``, and the
    piece after the Function receives it as a Python number."""

    def __init__(self, temp: float = 1.0):
        super().__init__()
        self.emb, self.body, self.head = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50)
        self.temp = temp

    def forward(self, ids):
        h = self.emb(ids) / self.temp
        h = GradReverse.apply(self.body(h), 0.5)
        return nn.functional.cross_entropy((self.head(h) * self.temp).view(-1, 50), ids.view(-1))


_CXX = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor on CPU needs a C++ compiler")


@pytest.mark.parametrize("inductor", [False, pytest.param(True, marks=_CXX)])
def test_a_float_attribute_changed_every_step_is_read_anew_by_every_piece(inductor):
    """Each step's value reaches both pieces: the first compiles the number it reads into a copy per value,
    and the second, which gets it from the first, is compiled per value too (it had kept the first value
    it was compiled with: a wrong loss from the third step)."""
    torch.manual_seed(0)
    ref = Annealed()
    model = copy.deepcopy(ref)
    opt = opsmath.optimize(model, inductor=inductor)
    ids = torch.randint(0, 50, (2, 8))
    for step in range(5):
        model.temp = ref.temp = 1.0 + 0.5 * step
        step_equals_eager(model, ref, (ids,), run=opt)
    assert not opsmath.report(opt).fallback_errors


@_CXX
def test_a_second_model_whose_float_attribute_differs_compiles_its_pieces():
    """The second model's pieces read its eps as a number: compiled with it in place by Inductor, not run
    op by op after Inductor failed on the ``.item()``."""
    ids = torch.randint(0, 50, (2, 8))
    for temp in (1.0, 2.0):
        torch.manual_seed(0)
        ref = Annealed(temp)
        opt = opsmath.optimize(copy.deepcopy(ref), inductor=True)
        torch.testing.assert_close(opt(ids), ref(ids), rtol=1e-5, atol=1e-6)
        assert not opsmath.report(opt).fallback_errors, opsmath.report(opt).fallback_errors


class AnnealedBlocks(nn.Module):
    """Three blocks, each reading the float attribute: ``AdamW(in_backward=True)`` captures one graph per
    block, and the attribute's value passes from piece to piece."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.temp = 1.0

    def forward(self, ids):
        h = self.emb(ids) * self.temp
        for b in self.blocks:
            h = torch.tanh(b(h)) * self.temp
        return nn.functional.cross_entropy((self.head(h) / self.temp).view(-1, 50), ids.view(-1))


def test_per_block_graphs_read_a_float_attribute_changed_every_step():
    """The optimizer stepping inside backward, one graph per block: each step's value reaches every block
    (the block graphs had kept the value of their compile: parameters off by 1e-2 from the third step)."""
    torch.manual_seed(0)
    ref = AnnealedBlocks()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_model = opsmath.optim.AdamW(model.parameters(), lr=1e-2, in_backward=True)
    opt = opsmath.optimize(model)
    ids = torch.randint(0, 50, (2, 8))
    for step in range(5):
        model.temp = ref.temp = 1.0 + 0.5 * step
        opt(ids).backward()
        opt_model.step()
        opt_model.zero_grad()
        ref(ids).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
