"""Index-comparison masks read symbolically (``src/opsmath/patterns/attention/masks.py``): the reading must equal
the mask's values, and only the exact top-left causal pattern may be called causal."""
import operator

import pytest
import torch
import torch.fx as fx

from opsmath.patterns.attention.masks import is_causal_index_mask, key_minus_query

aten = torch.ops.aten
S = 7


def _mask_graph(cmp, q_off=0, k_off=0, swap_axes=False, slice_end=2 ** 63 - 1):
    """``cmp(k_index + k_off, q_index + q_off)`` as HF's sdpa mask spells it, expanded to (2, 1, S, S)."""
    g = fx.Graph()

    def idx(off, axis_last):
        n = g.call_function(aten.arange.default, (S,))
        if off:
            n = g.call_function(aten.add.Tensor, (n, off))
        n = g.call_function(aten.unsqueeze.default, (n, 0))
        n = g.call_function(aten.unsqueeze.default, (n, 1))
        n = g.call_function(aten.slice.Tensor, (n, 2, 0, slice_end))
        return g.call_function(aten.unsqueeze.default, (n, 2 if axis_last else 3))
    k, q = idx(k_off, not swap_axes), idx(q_off, swap_axes)
    out = g.call_function(aten.expand.default, (g.call_function(cmp, (k, q)), [2, -1, S, S]))
    g.output(out)
    return fx.GraphModule(torch.nn.Module(), g), out


@pytest.mark.parametrize("cmp", [aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor])
@pytest.mark.parametrize("q_off,k_off,swap", [(0, 0, False), (0, 0, True), (2, 0, False), (0, 3, False),
                                              (-1, 1, True)])
def test_reading_equals_the_values(cmp, q_off, k_off, swap):
    gm, out = _mask_graph(cmp, q_off, k_off, swap)
    rel, d, _, _ = key_minus_query(out)
    values = gm()
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    expected = (j - i <= d) if rel == "le" else (j - i >= d)
    assert torch.equal(values[0, 0], expected), (rel, d)


def test_only_the_exact_causal_pattern_is_causal():
    assert is_causal_index_mask(_mask_graph(aten.le.Tensor)[1], removes=False, Sq=S, Sk=S)      # keep j <= i
    assert is_causal_index_mask(_mask_graph(aten.gt.Tensor)[1], removes=True, Sq=S, Sk=S)       # remove j > i
    assert not is_causal_index_mask(_mask_graph(aten.le.Tensor)[1], removes=True, Sq=S, Sk=S)
    assert not is_causal_index_mask(_mask_graph(aten.lt.Tensor)[1], removes=False, Sq=S, Sk=S)  # diagonal gone
    assert not is_causal_index_mask(_mask_graph(aten.le.Tensor, q_off=1)[1], removes=False, Sq=S, Sk=S)
    assert not is_causal_index_mask(_mask_graph(aten.le.Tensor, swap_axes=True)[1], removes=False, Sq=S, Sk=S)
    assert not is_causal_index_mask(_mask_graph(aten.le.Tensor)[1], removes=False, Sq=S, Sk=S + 1)
    assert key_minus_query(_mask_graph(aten.le.Tensor, slice_end=3)[1]) is None   # not the whole range


def test_a_sliding_window_is_not_causal():
    """``j <= i and j > i - w`` (a window): the AND is not an index comparison, so nothing is claimed."""
    gm, causal = _mask_graph(aten.le.Tensor)
    window = gm.graph.call_function(aten.gt.Tensor, (causal.args[0].args[0], causal.args[0].args[1]))
    both = gm.graph.call_function(aten.logical_and.default, (causal, window))
    assert not is_causal_index_mask(both, removes=False, Sq=S, Sk=S)
    assert key_minus_query(both) is None


def _fill_graph(shared: bool):
    """``zeros(S, S).masked_fill_(triu(ones, 1), -inf)`` (nn.MultiheadAttention's bool-mask-to-bias), with the
    zeros also read by another op when ``shared``."""
    g = fx.Graph()
    ones = g.call_function(aten.ones.default, ([S, S],), {"dtype": torch.bool})
    mask = g.call_function(aten.triu.default, (ones, 1))
    zeros = g.call_function(aten.zeros.default, ([S, S],))
    other = g.call_function(aten.add.Tensor, (zeros, 1.0)) if shared else None
    fill = g.call_function(aten.masked_fill_.Scalar, (zeros, mask, float("-inf")))
    g.output((fill, other) if shared else fill)
    return fx.GraphModule(torch.nn.Module(), g), fill


def test_an_in_place_fill_is_a_constant_only_when_nothing_else_reads_its_target():
    from opsmath.rewrite.canonicalize import constant_value
    gm, fill = _fill_graph(shared=False)
    value = constant_value(gm, fill, {})
    assert value is not None and torch.equal(value, torch.zeros(S, S).masked_fill(torch.ones(S, S).triu(1).bool(),
                                                                                  float("-inf")))
    gm, fill = _fill_graph(shared=True)
    assert constant_value(gm, fill, {}) is None


@pytest.mark.parametrize("write", [None, "through_a_view", "in_place", "after_a_split", "after_an_unsafe_split",
                                   "set_"])
def test_a_tensor_written_by_a_node_outside_the_evaluation_is_not_a_constant(write):
    """``kpm = zeros(B, S); kpm[1, 3:] = True`` (the write goes through a view, a node no reader depends on):
    evaluating ``where(kpm, -inf, 0)`` from its factory alone would miss the write, so it is no constant.
    A write to another tensor (``masked_fill_(x, kpm, ...)`` writes x) does not count."""
    from opsmath.rewrite.canonicalize import constant_value
    g = fx.Graph()
    x = g.placeholder("x")
    kpm = g.call_function(aten.zeros.default, ([2, S],), {"dtype": torch.bool})
    if write == "through_a_view":
        g.call_function(aten.fill_.Scalar, (g.call_function(aten.slice.Tensor, (kpm, 1, 3)), True))
    elif write == "in_place":
        g.call_function(aten.logical_not_.default, (kpm,))
    elif write in ("after_a_split", "after_an_unsafe_split"):
        split = aten.split.Tensor if write == "after_a_split" else aten.unsafe_split.Tensor
        part = g.call_function(operator.getitem, (g.call_function(split, (kpm, 1)), 1))
        g.call_function(aten.fill_.Scalar, (part, True))
    elif write == "set_":   # another tensor made to share kpm's storage, then written
        other = g.call_function(aten.empty.memory_format, ([0],), {"dtype": torch.bool})
        g.call_function(aten.fill_.Scalar, (g.call_function(aten.set_.source_Tensor, (other, kpm)), True))
    bias = g.call_function(aten.where.Scalar, (kpm, float("-inf"), 0.0))
    g.call_function(aten.masked_fill_.Scalar, (x, kpm, 0.0))   # writes x, reads kpm
    g.output(bias)
    gm = fx.GraphModule(torch.nn.Module(), g)
    value = constant_value(gm, bias, {})
    assert (value is None) == (write is not None)
    if write is None:
        assert torch.equal(value, torch.zeros(2, S))
