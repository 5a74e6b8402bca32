"""Sliding-window attention: masks that combine the causal comparison, a window ``j > i - w`` and other
conditions (padding) are split; the causal and window conjuncts become the kernel's ``is_causal`` and
``window`` (blocks outside are skipped), the rest stays a mask. Additive masks with other conditions keep
their window in the bias (a fully masked row's uniform weights depend on every key), exactly as eager."""
import copy

import pytest
import torch
import torch.nn.functional as F

import opsmath
from attention_harness import D, T, AttnModel, _compare, _inputs
from tolerance import grads_close, rel_err

W = 4


def _ij(x):
    i = torch.arange(T, device=x.device)[:, None]
    j = torch.arange(T, device=x.device)[None, :]
    return i, j


def sdpa_keep_causal_window_padding(q, k, v, m):
    """HF's SDPA mask: ``causal & sliding_window & padding`` as a boolean keep-mask."""
    i, j = _ij(q)
    keep = (j <= i)[None, None] & (j > i - W)[None, None] & m.pad.bool()[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def eager_additive_causal_window(q, k, v, m):
    """HF's eager mask without padding: ``where(causal & window, 0, finfo.min)`` added to the scores."""
    i, j = _ij(q)
    bias = torch.where(torch.ones(T, T, dtype=torch.bool) & (j > i - W) & (j <= i), 0.0, torch.finfo(q.dtype).min)
    return F.softmax(q @ k.transpose(-2, -1) * D ** -0.5 + bias, dim=-1) @ v


def eager_additive_with_padding(q, k, v, m):
    i, j = _ij(q)
    keep = (j <= i)[None, None] & (j > i - W)[None, None] & m.pad.bool()[:, None, None, :]
    bias = torch.where(keep, 0.0, torch.finfo(q.dtype).min)
    return F.softmax(q @ k.transpose(-2, -1) * D ** -0.5 + bias, dim=-1) @ v


def remove_mask_or(q, k, v, m):
    """A remove-mask spelled as a union: ``(j > i) | (j <= i - w)`` filled with -inf."""
    i, j = _ij(q)
    att = (q @ k.transpose(-2, -1)) * D ** -0.5
    return F.softmax(att.masked_fill((j > i) | (j <= i - W), float("-inf")), dim=-1) @ v


def window_without_causal(q, k, v, m):
    """A one-sided window on bidirectional attention (every row keeps its diagonal)."""
    i, j = _ij(q)
    att = (q @ k.transpose(-2, -1)) * D ** -0.5
    return F.softmax(att.masked_fill(j - i < 1 - W, float("-inf")), dim=-1) @ v


def right_window_is_not_causal(q, k, v, m):
    """``j < i + w`` bounds the keys from the right: neither causal nor a (left) window; a mask."""
    i, j = _ij(q)
    att = (q @ k.transpose(-2, -1)) * D ** -0.5
    return F.softmax(att.masked_fill(j >= i + W, float("-inf")), dim=-1) @ v


SPELLINGS = {  # fn: (causal, window, has_mask, has_bias)
    sdpa_keep_causal_window_padding: (True, W, True, False),
    eager_additive_causal_window: (True, W, False, False),
    eager_additive_with_padding: (False, 0, False, True),
    remove_mask_or: (True, W, False, False),
    window_without_causal: (False, W, False, False),
    right_window_is_not_causal: (False, 0, True, False),
}


@pytest.mark.parametrize("fn", list(SPELLINGS), ids=lambda f: f.__name__)
def test_window_spellings_are_read_and_exact(fn):
    torch.manual_seed(0)
    x, pad = _inputs()
    pad[2, 5:] = 1   # no row is wholly padding inside its window (SDPA's fully masked rows are NaN in eager)
    rep = _compare(AttnModel(fn), x, pad)
    assert rep.count("attention") == 1, rep.render(width=120)
    d = rep.matches[0].details
    assert (d["causal"], d["window"], d["has_mask"], d["has_bias"]) == SPELLINGS[fn], d
    assert d["window_in_mask"] == (W if fn is eager_additive_with_padding else 0), d


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("attn,padded", [("sdpa", True), ("sdpa", False), ("eager", False)])
def test_hf_mistral_sliding_window_is_skipped_blockwise(attn, padded):
    """Mistral with ``sliding_window``: every layer's attention gets ``window`` (with padding, SDPA's
    boolean mask keeps the padding conjunct), and loss and gradients equal eager."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(attn_implementation=attn, vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                     sliding_window=5)
    model = transformers.MistralForCausalLM(cfg).train()
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    ids = torch.randint(0, 128, (2, 19))
    kw = dict(input_ids=ids, labels=ids)
    if padded:
        kw["attention_mask"] = torch.ones(2, 19, dtype=torch.long)
        kw["attention_mask"][1, 16:] = 0
    loss, loss_e = opt(**kw).loss, eager(**kw).loss
    loss.backward()
    loss_e.backward()
    rep = opsmath.report(opt)
    windows = [m.details["window"] for m in rep.matches if m.pattern == "attention"]
    assert windows == [5, 5], rep.render(width=120)
    assert rel_err(loss, loss_e) < 1e-5
    for (name, p), q in zip(opt.named_parameters(), eager.parameters()):
        assert grads_close(p.grad, q.grad, 1e-4, 1e-6), name


def documents(q, k, v, m):
    """Packed sequences (document masking): keys of the same document, causal, as an SDPA keep-mask."""
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2])
    i, j = _ij(q)
    keep = (j <= i) & (doc[:, None] == doc[None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[None, None] & m.pad.bool()[:, None, None, :])


def test_document_mask_keeps_causal_skipping():
    """A constant document mask implies ``is_causal`` and a window of its longest document (5 keys):
    blocks outside both are skipped, the mask itself stays; outputs and gradients equal eager."""
    torch.manual_seed(0)
    x, pad = _inputs()
    pad[:] = 1
    rep = _compare(AttnModel(documents), x, pad)
    d = rep.matches[0].details
    assert (d["causal"], d["window"], d["has_mask"]) == (True, 5, True), d


def test_hf_left_padding_under_sdpa_stays_finite():
    """Left padding under HF's SDPA mask: a padded query row sees no key at all. SDPA returns 0 for it;
    the rewrite must too (it used to return NaN, which reached every gradient)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(attn_implementation="sdpa", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    model = transformers.LlamaForCausalLM(cfg).train()
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    ids = torch.randint(0, 128, (2, 13))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    loss = opt(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss_e = eager(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    loss_e.backward()
    assert opsmath.report(opt).count("attention") == 2
    assert torch.isfinite(loss) and rel_err(loss, loss_e) < 1e-5
    for (name, p), q in zip(opt.named_parameters(), eager.parameters()):
        assert grads_close(p.grad, q.grad, 1e-4, 1e-6), name


def test_window_is_read_at_a_symbolic_sequence_length():
    """A second sequence length recompiles with a symbolic length: HF's index-built window mask is read
    at every length (``j - i`` comparisons), so the dynamic graph keeps ``window``, exactly as eager."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(attn_implementation="sdpa", vocab_size=128, hidden_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                     sliding_window=5)
    model = transformers.MistralForCausalLM(cfg).train()
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    for T in (19, 23):
        ids = torch.randint(0, 128, (2, T))
        loss, loss_e = opt(input_ids=ids, labels=ids).loss, eager(input_ids=ids, labels=ids).loss
        assert rel_err(loss, loss_e) < 1e-5
    rep = opsmath.report(opt)
    assert rep.graphs[-1].dynamic, [g.dynamic for g in rep.graphs]
    assert [m.details["window"] for m in rep.graphs[-1].matches if m.pattern == "attention"] == [5]
