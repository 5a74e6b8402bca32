"""The declarative pattern matcher (``src/opsmath/rewrite/declare.py``): a pattern traced from a function
matches the graphs models produce in any operand order of add/mul, binds each input consistently,
compares literals, and a rule built on it declines an occurrence whose intermediate is read elsewhere."""
import math

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from opsmath.rewrite.declare import find, trace_pattern
from opsmath.patterns.swiglu import SwiGLURule


def out_node(fn, *shapes):
    gm = make_fx(fn)(*[torch.randn(s) for s in shapes])
    return gm, gm.graph.find_nodes(op="output")[0].args[0]


def test_either_operand_order_and_inputs_bound_by_name():
    pat = trace_pattern(lambda a, b: F.silu(a) * b)
    for fn in (lambda x, y: F.silu(x) * y, lambda x, y: y * F.silu(x)):
        gm, out = out_node(fn, (3, 5), (3, 5))
        m = find(pat, out)
        x, y = gm.graph.find_nodes(op="placeholder")
        assert m is not None and m["a"] is x and m["b"] is y and m.nodes[-1] is out
    _, other = out_node(lambda x, y: F.gelu(x) * y, (3, 5), (3, 5))
    assert find(pat, other) is None


def test_an_input_used_twice_must_be_the_same_node():
    pat = trace_pattern(lambda h: h * torch.tanh(h))
    gm, out = out_node(lambda x: x * torch.tanh(x), (4,))
    assert find(pat, out) is not None
    _, out2 = out_node(lambda x, y: x * torch.tanh(y), (4,), (4,))
    assert find(pat, out2) is None


def test_literals_must_agree():
    gelu = lambda h: 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))  # noqa: E731
    pat = trace_pattern(gelu)
    # HF's spelling with ints, the cube written as h ** 3, and the inner sum in the other order
    _, out = out_node(lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (0.044715 * x ** 3 + x))), (6,))
    m = find(pat, out)
    assert m is not None and len(m.nodes) == 8
    _, wrong = out_node(lambda x: 0.5 * x * (1 + torch.tanh(0.8 * (x + 0.044715 * x ** 3))), (6,))
    assert find(pat, wrong) is None


def test_rule_declines_when_an_intermediate_is_read_elsewhere():
    rule = SwiGLURule()
    gm, out = out_node(lambda x, y: F.silu(x) * y, (3, 5), (3, 5))
    assert not isinstance(rule.match(None, out), str)
    gm2 = make_fx(lambda x, y: (F.silu(x) * y, F.silu(x).sum()))(torch.randn(3, 5), torch.randn(3, 5))
    mul = next(n for n in gm2.graph.nodes if n.target == torch.ops.aten.mul.Tensor)
    s = mul.args[0]
    total = next(n for n in gm2.graph.nodes if n.target == torch.ops.aten.sum.default)
    total.replace_input_with(total.args[0], s)
    assert rule.match(None, mul) == "silu(a) is also read elsewhere, so it must exist"
    _, bcast = out_node(lambda x, y: F.silu(x) * y, (3, 5), (5,))
    assert "broadcast" in rule.match(None, bcast)
