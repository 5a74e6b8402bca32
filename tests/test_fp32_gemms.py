"""fp32 GEMMs that read a bf16 value, on bf16 tensor cores (``runtime/fp32_gemms.py``): the joint-graph
rewrite on fake CUDA tensors (CPU), the three-term split's exactness, and on the GPU an attention with a
learned bias (SDPA's fp32 math path) trained against eager under autocast."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from opsmath.runtime import fp32_gemms

aten, prims = torch.ops.aten, torch.ops.prims


def _graph(device="cuda", scaled_q=False):
    """``softmax(up(q) @ up(k)^T) @ up(v)``-shaped bmm's: ``q @ k^T`` of two upcast bf16 values (``scaled_q``:
    ``q`` scaled in fp32 first, a true fp32 value), a true fp32 ``p`` times an upcast ``v`` behind a view, and
    a GEMM of two true fp32 values."""
    with FakeTensorMode():
        q, k, v = (torch.empty(6, 17, 8, device=device, dtype=torch.bfloat16) for _ in range(3))
        f = torch.empty(6, 8, 5, device=device)

        def joint(q, k, v, f):
            up = lambda t: prims.convert_element_type(t, torch.float32)   # noqa: E731
            s = aten.bmm(aten.mul(up(q), 2.0) if scaled_q else up(q), aten.permute(up(k), [0, 2, 1]))
            p = aten._softmax(s, -1, False)
            o = aten.bmm(p, aten.view(up(v), [6, 17, 8]))
            return [o, aten.bmm(aten.mul(o, 1.0), f)]   # true fp32 x true fp32: left alone
        return make_fx(joint)(q, k, v, f)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_exact_operands_go_to_bf16_gemms_and_a_true_fp32_one_in_three_terms():
    gm = _graph()
    before = [n.meta["val"] for n in gm.graph.output_node().args[0]]
    assert fp32_gemms.fp32_gemms(gm.graph) == 2
    gm.recompile()
    t = _targets(gm)
    assert t.count(aten.bmm.dtype) == 1 + 3 and t.count(aten.bmm.default) == 1   # q k^T; p v split; f kept
    for n in gm.graph.find_nodes(op="call_function", target=aten.bmm.dtype):
        assert all(a.meta["val"].dtype == torch.bfloat16 for a in n.args[:2]) and n.args[2] is torch.float32
    after = [n.meta["val"] for n in gm.graph.output_node().args[0]]
    assert [(a.shape, a.dtype) for a in after] == [(b.shape, b.dtype) for b in before]


def test_true_fp32_products_and_other_devices_are_left_alone():
    gm = _graph(scaled_q=True)   # q k^T reads a true fp32 q beside an exact k: split too
    assert fp32_gemms.fp32_gemms(gm.graph) == 2
    gm.recompile()
    assert _targets(gm).count(aten.bmm.dtype) == 3 + 3 and _targets(gm).count(aten.bmm.default) == 1
    cpu = _graph("cpu")   # bmm.dtype has no CPU kernel
    assert fp32_gemms.fp32_gemms(cpu.graph) == 0


def test_the_three_terms_sum_to_the_fp32_value_and_the_product_to_fp32s_accuracy():
    """The split as the pass computes it (round to bf16, subtract in fp32, three times) is exact for normal
    values, and the bf16 x bf16 products summed in fp32 are within fp32's GEMM error of fp64."""
    torch.manual_seed(0)
    f = torch.randn(37, 29) * torch.logspace(-8, 8, 29)
    terms, rest = [], f
    for _ in range(3):
        t = rest.to(torch.bfloat16)
        terms.append(t)
        rest = rest - t.float()
    assert torch.equal(terms[0].float() + terms[1].float() + terms[2].float(), f)
    x = torch.randn(41, 37).to(torch.bfloat16)
    ref = x.double() @ f.double()
    split = sum(x.float() @ t.float() for t in reversed(terms))
    fp32 = x.float() @ f
    assert (split.double() - ref).norm() <= 2 * (fp32.double() - ref).norm() + 1e-30


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("OPSMATH_FP32_GEMMS", raising=False)
    assert fp32_gemms.joint_pass() is None
    monkeypatch.setenv("OPSMATH_FP32_GEMMS", "1")
    assert (fp32_gemms.joint_pass() is not None) == fp32_gemms._lowered()


class _BiasAttention(torch.nn.Module):
    """T5's attention: a learned per-head bias (its gradient needed) added to the scores, SDPA's math path."""

    def __init__(self, c=64, heads=4, t=48):
        super().__init__()
        self.heads, self.qkv, self.o = heads, torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)
        self.bias = torch.nn.Parameter(torch.randn(1, heads, t, t) * 0.5)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return self.o(y.transpose(1, 2).reshape(B, T, C)).float().square().mean()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bmm.dtype runs on CUDA only")
def test_on_the_gpu_a_learned_bias_attention_trains_within_the_tolerance_rule(monkeypatch):
    """Tolerance rule: against the fp32 model, each gradient's error is at most 2x eager autocast's + atol."""
    import copy
    import opsmath
    monkeypatch.setenv("OPSMATH_FP32_GEMMS", "1")
    torch.manual_seed(0)
    ref = _BiasAttention().cuda()
    eager, model = copy.deepcopy(ref), opsmath.optimize(copy.deepcopy(ref), skip=["attention"])
    x = torch.randn(3, 48, 64, device="cuda")
    ref(x).backward()
    before = fp32_gemms.REWRITTEN[0]
    for m in (eager, model):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(x)
        loss.backward()
    assert fp32_gemms.REWRITTEN[0] > before
    for (name, p), e, o in zip(ref.named_parameters(), eager.parameters(), model.parameters()):
        eager_err, err = (e.grad - p.grad).norm(), (o.grad - p.grad).norm()
        assert err <= 2 * eager_err + 1e-5 * p.grad.norm(), (name, err, eager_err)
