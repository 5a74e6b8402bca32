"""The loss head compiled as a graph of its own where the model also returns the logits it reads
(``capture/loss_head.py``): the body's backward gets the logits' real gradient, never a zero tensor
autograd materializes for an unread output; values and gradients stay eager's."""
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import opsmath
from opsmath.capture import loss_head as loss_head_mod

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="Inductor on CPU needs a C++ compiler")
V, D, B, T = 96, 32, 2, 16


class TaskModel(torch.nn.Module):
    """An HF-style task model: ``(loss, logits)``, the loss computed from the returned logits."""

    def __init__(self, aux_weight: bool = False):
        super().__init__()
        self.emb, self.body = torch.nn.Embedding(V, D), torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V, bias=False)
        self.aux_weight = aux_weight

    def forward(self, ids, labels):
        with torch.autocast("cpu", enabled=False):   # a mode region in the graph (HF's rotary embedding)
            h = torch.tanh(self.body(self.emb(ids)).float())
        logits = self.head(h)
        shift = logits[:, :-1].float().reshape(-1, V)
        loss = F.cross_entropy(shift, labels[:, 1:].reshape(-1), ignore_index=-100)
        if self.aux_weight:   # a head that applies a parameter to the logits is not split off
            loss = loss + 1e-3 * (logits @ self.head.weight).square().mean()
        return loss, logits, h.detach().norm()   # the body's last node after the head's in the graph


def _pair(**kw):
    torch.manual_seed(0)
    ref = TaskModel(**kw)
    model = TaskModel(**kw)
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, V, (B, T))
    labels = ids.clone()
    labels[0, :3] = -100
    return ref, model, (ids, labels)


@pytest.fixture
def any_size(monkeypatch):
    monkeypatch.setattr(loss_head_mod, "MIN_BYTES", 0)   # the test's logits are small


class ZerosOfShape(TorchDispatchMode):
    """Counts the zero tensors of one shape created while active (autograd's materialized gradients)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = torch.Size(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.zeros, torch.ops.aten.zeros_like, torch.ops.aten.new_zeros) \
                and isinstance(out, torch.Tensor) and out.shape == self.shape:
            self.count += 1
        return out


def _step(model, batch, read_logits: bool):
    loss, logits, _ = model(*batch)
    total = loss + logits.float().mean() if read_logits else loss
    mode = ZerosOfShape(logits.shape)
    with mode:
        total.backward()
    return loss, mode.count


@pytest.mark.parametrize("read_logits", [False, True])
def test_split_head_equals_eager_and_gets_no_zero_gradient(any_size, read_logits):
    ref, model, batch = _pair()
    opt = opsmath.optimize(model, inductor=True)
    loss, zeros = _step(opt, batch, read_logits)
    ref_loss, _ = _step(ref, batch, read_logits)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    rep = opsmath.report(opt)
    assert len(rep.graphs) == 2 and any("loss computed from `logits`" in n for n in rep.notes), rep.notes
    assert zeros == 0


def test_one_graph_materializes_the_zero_gradient(monkeypatch):
    """What the split mends: one graph's backward takes a logits-sized zero tensor (the logits are below
    ``MIN_BYTES`` here, so the graph is not split)."""
    ref, model, batch = _pair()
    opt = opsmath.optimize(model, inductor=True)
    _, zeros = _step(opt, batch, read_logits=False)
    assert len(opsmath.report(opt).graphs) == 1 and zeros == 1


def test_head_reading_a_parameter_is_not_split(any_size):
    ref, model, batch = _pair(aux_weight=True)
    opt = opsmath.optimize(model, inductor=True)
    loss, _ = _step(opt, batch, read_logits=False)
    ref_loss, _ = _step(ref, batch, read_logits=False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert len(opsmath.report(opt).graphs) == 1


class BufferAfterLoss(TaskModel):
    """The loss reads a buffer the forward then updates in place: the head must not move past the write."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, ids, labels):
        loss, logits, norm = super().forward(ids, labels)
        loss = loss + self.scale
        self.scale.mul_(0.5)
        return loss, logits, norm


def test_head_reading_a_buffer_written_later_is_not_split(any_size):
    torch.manual_seed(0)
    ref = BufferAfterLoss()
    model = BufferAfterLoss()
    model.load_state_dict(ref.state_dict())
    opt = opsmath.optimize(model, inductor=True)
    ids = torch.randint(0, V, (B, T))
    for _ in range(2):
        torch.testing.assert_close(opt(ids, ids)[0], ref(ids, ids)[0], rtol=1e-5, atol=1e-6)
    assert len(opsmath.report(opt).graphs) == 1


class LossUnderEnableGrad(TaskModel):
    def forward(self, ids, labels):
        with torch.enable_grad():   # a model called under no_grad that differentiates its own loss
            return super().forward(ids, labels)


def test_loss_inside_an_enable_grad_block_keeps_its_gradient(any_size):
    """Moved past the block's end the head would run without grad: the loss must still need one."""
    torch.manual_seed(0)
    model = LossUnderEnableGrad()
    opt = opsmath.optimize(model, inductor=True)
    ids = torch.randint(0, V, (B, T))
    with torch.no_grad():
        loss, _, _ = opt(ids, ids)
    assert loss.requires_grad
    assert torch.autograd.grad(loss, model.head.weight)[0].abs().sum() > 0


def test_varying_lengths_compile_each_piece_once_more_with_symbolic_sizes(any_size):
    """After dynamo's second trace (symbolic sizes) the body and the head compile once each with symbolic
    sizes at their first call: four compiles for four lengths, none per later length."""
    ref, model, _ = _pair()
    opt = opsmath.optimize(model, inductor=True)
    for t in (16, 24, 32, 40):
        ids = torch.randint(0, V, (B, t))
        loss, _ = _step(opt, (ids, ids.clone()), read_logits=False)
        ref_loss, _ = _step(ref, (ids, ids.clone()), read_logits=False)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    rep = opsmath.report(opt)
    assert [g.dynamic for g in rep.graphs] == [False, False, True, True], [g.input_shapes for g in rep.graphs]


class WithCache(TaskModel):
    """A model that returns a per-layer value needing a gradient beside its loss (as HF's K/V cache)."""

    def forward(self, ids, labels):
        loss, logits, norm = super().forward(ids, labels)
        return loss, logits, torch.tanh(self.body(self.emb(ids))) * 2


def test_returned_tensors_beside_the_loss_are_reported(any_size):
    """Each gets a zero gradient in backward where the caller does not backpropagate through it: the
    report says how many and how large; the logits the loss head reads are not among them."""
    torch.manual_seed(0)
    opt = opsmath.optimize(WithCache(), inductor=True)
    ids = torch.randint(0, V, (B, T))
    opt(ids, ids)[0].backward()
    notes = [n for n in opsmath.report(opt).notes if "returned beside the loss" in n]
    assert len(notes) == 1 and ": 1, " in notes[0], opsmath.report(opt).notes
    ref, model, batch = _pair()
    opt = opsmath.optimize(model, inductor=True)
    _step(opt, batch, read_logits=False)
    assert not [n for n in opsmath.report(opt).notes if "returned beside the loss" in n]


def test_pieces_run_op_by_op_where_inductor_fails(any_size, monkeypatch):
    """The fallback ladder's last rung on a split graph: each piece runs its rewritten graph op by op and
    hands the next what the split graph passes (the body's one output as itself, not in a list)."""
    from opsmath.runtime import backend

    def fail(gm, *args, **kwargs):   # as Inductor's compile_fx, which makes a one-output graph return a tuple
        out = gm.graph.output_node()   # in place before compiling (make_graph_return_tuple), then fails
        if isinstance(out.args[0], torch.fx.Node):
            out.args = ((out.args[0],),)
            gm.recompile()
        raise RuntimeError("injected Inductor failure")
    monkeypatch.setattr(backend, "compile_fx", fail)
    ref, model, batch = _pair()
    opt = opsmath.optimize(model, inductor=True)
    loss, _ = _step(opt, batch, read_logits=True)
    ref_loss, _ = _step(ref, batch, read_logits=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    rep = opsmath.report(opt)
    assert len(rep.graphs) == 2 and sum("op by op" in e for e in rep.fallback_errors) == 2, rep.fallback_errors


class Normed(TaskModel):
    """A norm whose eps is a float attribute: two models of the class with different eps in one process."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, ids, labels):
        h = self.emb(ids)
        h = h / (h.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, V), labels.view(-1)), logits


def test_a_second_model_whose_float_attribute_differs_splits_its_head_too(any_size):
    """Dynamo passes a float attribute that changed since its first capture as a tensor it reads with
    ``.item()``: the body piece compiles with the number in place (``pieces.with_numbers``; compiled on
    its own, without dynamo's shape environment, Inductor could not read it), so the second model's head
    splits off as the first's: no fallback, values and gradients as eager's."""
    ids = torch.randint(0, V, (B, T))
    for eps in (1e-6, 1e-5):
        torch.manual_seed(0)
        ref = Normed(eps)
        model = Normed(eps)
        model.load_state_dict(ref.state_dict())
        opt = opsmath.optimize(model, inductor=True)
        loss, ref_loss = opt(ids, ids)[0], ref(ids, ids)[0]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        ref_loss.backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        rep = opsmath.report(opt)
        assert len(rep.graphs) == 2 and not rep.fallback_errors, rep.fallback_errors


def test_a_budget_plans_for_the_gradient_of_the_returned_logits():
    """Under a byte budget the graph stays whole (the chunked loss needs the head's GEMM), so its backward
    takes a logits-sized gradient as it starts: the first plan holds those bytes at the end of the forward
    (``Plan.returned``), before any step measured them, and the report says what they are."""
    ref, model, batch = _pair()
    opt = opsmath.optimize(model, inductor=True, memory_budget=1 << 40)
    loss, zeros = _step(opt, batch, read_logits=False)
    ref_loss, _ = _step(ref, batch, read_logits=False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    rep = opsmath.report(opt)
    plan = rep.graphs[0].plan
    assert len(rep.graphs) == 1 and zeros == 1
    assert plan.returned == B * T * V * 4 and plan.head_excess >= plan.returned
    assert plan.predicted_peak >= plan.modelled[0] + plan.returned
    assert "returned beside the loss" in str(rep)
