"""Python scalars that tracing made CPU tensor constants (``y[..., 0] = 5``) move onto the readers' device
(``capture/scalars.py``): no host-to-device copy, no host sync, in a compiled step."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch._subclasses.fake_tensor import FakeTensorMode

import opsmath
from opsmath.capture.scalars import device_scalars

aten = torch.ops.aten


def _shifted(x):
    y = x.new_zeros(x.shape)
    y[..., 1:] = x[..., :-1]
    y[..., 0] = 5            # fill_(select(y), lift_fresh_copy(tensor(5.)))
    y[x > 0.5] = -1.5        # index_put_(y, [mask], lift_fresh_copy(tensor(-1.5)))
    return y * 2 + torch.tensor(3.0).sum()   # a CPU tensor the user made: read alone, it stays


def _moved(device: str):
    """``_shifted`` traced on the CPU, its values propagated as if its input lived on ``device``."""
    x = torch.randn(3, 7)
    gm = make_fx(_shifted, pre_dispatch=True)(x)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.empty(3, 7, device=device)))
    return gm, x, device_scalars(gm, mode)


def test_scalars_read_on_another_device_become_constants_there():
    gm, _, moved = _moved("meta")
    new = gm.graph.find_nodes(op="call_function", target=aten.scalar_tensor.default)
    assert moved == 2 and len(new) == 2
    assert sorted(n.args[0] for n in new) == [-1.5, 5.0]
    assert all(n.kwargs["device"] == torch.device("meta") and n.kwargs["dtype"] == torch.float32 for n in new)
    assert all(n.meta["val"].device.type == "meta" for n in new)
    left = [n.target for n in gm.graph.find_nodes(op="get_attr")]
    assert len(left) == 1 and hasattr(gm, left[0])                # the user's own CPU tensor
    assert len([n for n in dir(gm) if n.startswith("_tensor_constant")]) == 1


def test_moved_scalars_keep_every_value_and_dtype():
    """The same graph run on the CPU with the new constants (their device put back) gives ``_shifted``'s
    result bit for bit."""
    gm, x, _ = _moved("meta")
    for n in gm.graph.find_nodes(op="call_function", target=aten.scalar_tensor.default):
        n.kwargs = dict(n.kwargs, device=torch.device("cpu"))
    gm.recompile()
    assert torch.equal(gm(x), _shifted(x))


def test_a_cpu_graph_keeps_its_constants():
    gm, x, moved = _moved("cpu")
    assert moved == 0 and len(gm.graph.find_nodes(op="get_attr")) == 3
    assert torch.equal(gm(x), _shifted(x))


class _Shift(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(_shifted(x)).square().mean()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
def test_a_compiled_step_with_a_scalar_store_never_syncs():
    """T5's ``_shift_right`` spelling: after the first steps, opsmath's compiled forward and backward
    issue no synchronizing copy (a lifted CPU constant was copied to the GPU every step)."""
    torch.manual_seed(0)
    model = _Shift().cuda()
    opt_model = opsmath.optimize(model)
    x = torch.randn(4, 8, 16, device="cuda")
    for _ in range(2):
        opt_model(x).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = opt_model(x)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = _Shift().cuda()
    ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(loss, ref(x), rtol=1e-5, atol=1e-6)


def test_a_reader_computing_in_another_dtype_keeps_the_cpu_constant():
    """``x_bf16 * as_tensor(c)``: on CUDA a 0-dim CPU operand is read as a scalar in the kernel's compute type,
    a 0-dim CUDA one cast to bf16 first: not the same numbers, so the constant stays where it was."""
    def f(x):
        return x * torch.as_tensor(1 + 2 ** -20) + torch.as_tensor(2.0, dtype=torch.bfloat16)
    x = torch.randn(3, 7, dtype=torch.bfloat16)
    gm = make_fx(f, pre_dispatch=True)(x)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.empty(3, 7, device="meta", dtype=torch.bfloat16)))
    assert device_scalars(gm, mode) == 1   # the bf16 constant moves, the fp32 one stays
    (new,) = gm.graph.find_nodes(op="call_function", target=aten.scalar_tensor.default)
    assert new.kwargs["dtype"] == torch.bfloat16 and len(gm.graph.find_nodes(op="get_attr")) == 1
