"""fp32 weight gradients from their GEMMs (``runtime/wgrad.py``): the joint-graph rewrite on fake CUDA
tensors (CPU), and on the GPU a training step against eager under autocast."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from opsmath.runtime import wgrad

aten, prims = torch.ops.aten, torch.ops.prims


def _joint(primals_1, primals_2, tangents_1, dtype=torch.bfloat16):
    """A linear's joint graph as AOTAutograd traces it under autocast: ``y = x @ W.T`` with an fp32 weight
    (primal 1) and a bf16 activation (primal 2); outputs ``y``, then one gradient per primal."""
    w = prims.convert_element_type(primals_1, dtype)
    y = aten.mm(primals_2, aten.permute(w, [1, 0]))
    dw = aten.mm(aten.permute(tangents_1, [1, 0]), primals_2)             # (out, in), bf16
    dx = aten.mm(tangents_1, w)
    return [y, prims.convert_element_type(aten.permute(aten.permute(dw, [1, 0]), [1, 0]), torch.float32),
            prims.convert_element_type(dx, torch.float32)]


def _graph(device="cuda", dtype=torch.bfloat16):
    with FakeTensorMode():
        args = (torch.empty(24, 40, device=device), torch.empty(17, 40, device=device, dtype=dtype),
                torch.empty(17, 24, device=device, dtype=dtype))
        def joint(primals_1, primals_2, tangents_1):   # make_fx names the placeholders after the arguments
            return _joint(primals_1, primals_2, tangents_1, dtype)
        return make_fx(joint)(*args)


def _grad(gm, i):
    return gm.graph.output_node().args[0][i]


def test_a_parameter_gradient_is_written_in_fp32_by_its_gemm():
    gm = _graph()
    before = _grad(gm, 1).meta["val"]
    assert wgrad.fp32_weight_grads(gm.graph, frozenset({0})) == 1
    gm.recompile()
    grad = _grad(gm, 1)
    assert grad.meta["val"].dtype == torch.float32
    assert grad.meta["val"].shape == before.shape and grad.meta["val"].stride() == before.stride()
    assert len(gm.graph.find_nodes(op="call_function", target=aten.mm.dtype)) == 1
    casts = gm.graph.find_nodes(op="call_function", target=prims.convert_element_type.default)
    assert len(casts) == 2   # the weight's forward cast and the activation's gradient stay
    src = grad
    while src.target is not aten.mm.dtype:   # the views are kept, on the fp32 result
        assert src.target is aten.permute.default
        src = src.args[0]


def test_activation_gradients_and_other_devices_keep_eagers_rounding():
    gm = _graph()
    assert wgrad.fp32_weight_grads(gm.graph, frozenset()) == 0   # neither primal a parameter: nothing rewritten
    cpu = _graph("cpu")   # mm.dtype has no CPU kernel
    assert wgrad.fp32_weight_grads(cpu.graph, frozenset({0})) == 0
    fp16 = _graph(dtype=torch.float16)   # an overflow must reach GradScaler as eager's inf
    assert wgrad.fp32_weight_grads(fp16.graph, frozenset({0})) == 0


def test_a_gemm_read_elsewhere_is_left_alone():
    gm = _graph()
    mm = _grad(gm, 1)
    while mm.target is not aten.mm.default:
        mm = mm.args[0]
    with gm.graph.inserting_after(mm):
        other = gm.graph.call_function(aten.sum.default, (mm,))
    out = gm.graph.output_node()
    out.args = ([other, *out.args[0]],)   # a forward output: the gradients stay the last outputs
    assert wgrad.fp32_weight_grads(gm.graph, frozenset({0})) == 0


def test_the_report_line_says_where_the_pass_was_on_and_what_it_could_count():
    from types import SimpleNamespace as G
    assert wgrad.report_note([G(fp32_wgrad=None)]) == []   # CPU, or the pass off
    assert "3 GEMMs rewritten; " in wgrad.report_note([G(fp32_wgrad=3), G(fp32_wgrad=None)])[0]
    assert "in 2 graphs: 3 GEMMs rewritten (1 graphs count none: no such GEMM, or served from Inductor's cache)" \
        in wgrad.report_note([G(fp32_wgrad=3), G(fp32_wgrad=0)])[0]


def test_off_switch(monkeypatch):
    monkeypatch.setenv("OPSMATH_FP32_WGRAD", "0")
    assert wgrad.joint_pass(frozenset({0})) is None
    monkeypatch.delenv("OPSMATH_FP32_WGRAD")
    assert wgrad.joint_pass(frozenset({0})).cache_key == "fp32-wgrad [0]"


class _Block(torch.nn.Module):
    """Odd sizes, a tied-free MLP with biases, a linear without, and an embedding (whose gradient is no GEMM)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(61, 72)
        self.up, self.down = torch.nn.Linear(72, 200), torch.nn.Linear(200, 72, bias=False)
        self.head = torch.nn.Linear(72, 61)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1).float(), idx.flatten())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mm.dtype runs on CUDA only")
def test_on_the_gpu_fp32_weight_gradients_are_closer_to_fp32_than_eagers():
    """Tolerance rule: against the fp32 model, each gradient's error is at most 2x eager autocast's + atol."""
    import copy
    import opsmath
    torch.manual_seed(0)
    ref = _Block().cuda()
    eager, model = copy.deepcopy(ref), opsmath.optimize(copy.deepcopy(ref))
    idx = torch.randint(0, 61, (3, 129), device="cuda")
    ref(idx).backward()
    for m in (eager, model):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(idx)
        loss.backward()
    assert sum(g.fp32_wgrad or 0 for g in opsmath.report(model).graphs) == 3   # up, down, head
    for (name, p), e, o in zip(ref.named_parameters(), eager.parameters(), model.parameters()):
        eager_err, err = (e.grad - p.grad).norm(), (o.grad - p.grad).norm()
        assert err <= 2 * eager_err + 1e-5 * p.grad.norm(), (name, err, eager_err)
    assert "written in fp32 by the GEMM" in str(opsmath.report(model))
