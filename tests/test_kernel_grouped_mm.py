"""The grouped GEMM of the experts rewrite (``src/opsmath/kernels/grouped_mm.py``) against a per-group fp32 loop:
forward, both gradients, empty groups, rows past the last group, odd sizes; the native path
(``torch._grouped_mm``, bf16, aligned) and the per-group path (anything else)."""
import pytest
import torch

from opsmath.kernels import grouped_mm as gm
from opsmath.kernels.grouped_mm import grouped_mm, native, reference
from tolerance import assert_rule


def _offs(sizes):
    return torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)


def _grads(fn, x, w, dy):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype,S,K,N,sizes", [
    (torch.float32, 37, 13, 21, [5, 0, 20, 12]),      # odd sizes, an empty group: per-group path
    (torch.float32, 40, 16, 24, [40]),                 # one group
    (torch.bfloat16, 64, 32, 48, [10, 30, 0, 24]),     # aligned bf16: torch._grouped_mm
    (torch.bfloat16, 50, 30, 18, [25, 25]),            # unaligned bf16: per-group path
])
def test_grouped_mm_matches_per_group_products(dtype, S, K, N, sizes):
    torch.manual_seed(0)
    x, w, dy = torch.randn(S, K), torch.randn(len(sizes), K, N), torch.randn(S, N)
    offs = _offs(sizes)
    y, dx, dw = _grads(lambda a, b: grouped_mm(a, b, offs), x.to(dtype), w.to(dtype), dy.to(dtype))
    ye, dxe, dwe = _grads(lambda a, b: reference(a, b, offs).to(a.dtype), x.to(dtype), w.to(dtype), dy.to(dtype))
    yr, dxr, dwr = _grads(lambda a, b: reference(a, b, offs), x.double(), w.double(), dy.double())
    for got, eager, ref, name in ((y, ye, yr, "y"), (dx, dxe, dxr, "dx"), (dw, dwe, dwr, "dw")):
        assert_rule(got.float(), eager.float(), ref, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, name=name)
    empty = [g for g, s in enumerate(sizes) if s == 0]
    assert all(dw[g].abs().max() == 0 for g in empty), "an empty group's weight gradient is zero"


def test_rows_past_the_last_group_are_zero_on_the_per_group_path():
    x, w = torch.randn(10, 5), torch.randn(2, 5, 3)
    y = grouped_mm(x, w, _offs([3, 4]))
    assert torch.equal(y[7:], torch.zeros(3, 3))


def test_native_path_is_bf16_with_aligned_rows():
    assert native(torch.bfloat16, 1024, 2816)
    assert not native(torch.bfloat16, 1024, 2810)
    assert not native(torch.float32, 1024, 2816)
    assert not native(torch.float16, 64, 64)


@pytest.mark.parametrize("dtype,S,K,N,sizes", [
    (torch.float32, 150, 13, 21, [5, 0, 70, 0, 60]),   # odd sizes, empty groups, a group over two row tiles
    (torch.float16, 37, 24, 40, [20, 10]),              # fp16 (autocast fp16): rows past the last group
    (torch.bfloat16, 50, 30, 18, [25, 25]),             # unaligned bf16
])
def test_triton_grouped_mm_matches_per_group_products(dtype, S, K, N, sizes, triton_on_cpu, device, monkeypatch):
    """The Triton path (CUDA; on CPU Triton's interpreter): each row tile finds its group on the device.
    fp32, which the op keeps on cuBLAS, checks the kernels' indexing exactly."""
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 wrongly; the GPU runs this case")
    monkeypatch.setattr(gm, "TRITON_DTYPES", (torch.float32, torch.float16, torch.bfloat16))
    torch.manual_seed(1)
    x, w, dy = torch.randn(S, K), torch.randn(len(sizes), K, N), torch.randn(S, N)
    offs = _offs(sizes)
    y, dx, dw = (t.cpu() for t in _grads(lambda a, b: grouped_mm(a, b, offs.to(device)), x.to(device, dtype),
                                         w.to(device, dtype), dy.to(device, dtype)))
    ye, dxe, dwe = _grads(lambda a, b: reference(a, b, offs).to(a.dtype), x.to(dtype), w.to(dtype), dy.to(dtype))
    yr, dxr, dwr = _grads(lambda a, b: reference(a, b, offs), x.double(), w.double(), dy.double())
    end = sum(sizes)
    for got, eager, ref, name in ((y[:end], ye[:end], yr[:end], "y"), (dx[:end], dxe[:end], dxr[:end], "dx"),
                                  (dw, dwe, dwr, "dw")):
        assert_rule(got.float(), eager.float(), ref, atol=1e-2 if dtype != torch.float32 else 1e-5, name=name)
    assert torch.equal(y[end:].float(), torch.zeros(S - end, N)), "rows past the last group are zero"
    assert all(dw[g].abs().max() == 0 for g, s in enumerate(sizes) if s == 0)


@pytest.mark.parametrize("dtype,K,N", [(torch.float32, 16, 24), (torch.bfloat16, 16, 24), (torch.bfloat16, 12, 20)])
def test_a_linear_stacks_weight_gradient_arrives_in_its_layout(dtype, K, N, device):
    """Experts stored as ``nn.Linear`` stacks ([G, N, K], read through ``.transpose(1, 2)``): the weight
    gradient reaches the parameter in the parameter's own layout (no transposing copy into ``.grad``),
    on the per-group path, torch's grouped GEMM and the unaligned one, with the per-group values."""
    torch.manual_seed(0)
    w = torch.randn(3, N, K, dtype=dtype, device=device, requires_grad=True)
    x = torch.randn(11, K, dtype=dtype, device=device)
    offs = torch.tensor([4, 4, 11], dtype=torch.int32, device=device)
    arrived = []
    w.register_hook(lambda g: arrived.append(g.stride()))
    dy = torch.randn(11, N, dtype=dtype, device=device)
    grouped_mm(x, w.transpose(1, 2), offs).backward(dy)
    assert arrived == [w.stride()]
    for g, (s, e) in enumerate([(0, 4), (4, 4), (4, 11)]):
        want = (dy[s:e].float().t() @ x[s:e].float())
        assert torch.allclose(w.grad[g].float(), want, rtol=2e-2, atol=2e-2), g


@pytest.mark.parametrize("tile", range(max(len(gm.FWD_TILES), len(gm.WGRAD_TILES))))
def test_every_tile_the_tuner_may_pick_computes_the_same(tile, triton_on_cpu, device, monkeypatch):
    """Each of ``FWD_TILES`` and ``WGRAD_TILES`` (as the first-launch tuner may pick them; forced here):
    odd sizes, empty groups, a group spanning several row tiles, rows past the last group, in fp32."""
    from opsmath.kernels._common import forced_row_config
    monkeypatch.setattr(gm, "TRITON_DTYPES", (torch.float32,))
    torch.manual_seed(2)
    sizes = [3, 0, 140, 0, 50]
    S, K, N = 200, 70, 90
    x, w, dy, offs = torch.randn(S, K), torch.randn(len(sizes), K, N), torch.randn(S, N), _offs(sizes)
    with forced_row_config(tile):
        y, dx, dw = (t.cpu() for t in _grads(lambda a, b: grouped_mm(a, b, offs.to(device)), x.to(device),
                                             w.to(device), dy.to(device)))
    yr, dxr, dwr = _grads(lambda a, b: reference(a, b, offs), x.double(), w.double(), dy.double())
    end = sum(sizes)
    for got, ref, name in ((y[:end], yr[:end], "y"), (dx[:end], dxr[:end], "dx"), (dw, dwr, "dw")):
        torch.testing.assert_close(got.double(), ref.double(), rtol=1e-4, atol=1e-4, msg=name)
    assert torch.equal(y[end:], torch.zeros(S - end, N))


def _per_group_mm(x, w, offs):
    """cuBLAS's fp32 ``mm`` per group, autograd's backward: what HF's fallback runs in eager."""
    ends = [0] + offs.tolist()
    out = [x[s:e] @ w[g] for g, (s, e) in enumerate(zip(ends, ends[1:]))]
    return torch.cat(out + [x.new_zeros(x.shape[0] - ends[-1], w.shape[2])])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp32 on tensor cores (tf32x3) is CUDA's path")
@pytest.mark.parametrize("path", ["tf32x3", "split"])
@pytest.mark.parametrize("S,K,N,sizes,linear", [
    (4099, 1024, 1408, [700, 0, 1500, 9, 1890], True),    # HF's stacks read transposed, an empty group
    (2000, 1000, 700, [1000, 1000], False),                # odd K and N
    (3000, 2048, 512, [2999, 1], True),                    # imbalanced, long K
])
def test_fp32_on_tensor_cores_meets_the_tolerance_rule_of_cublas_fp32(S, K, N, sizes, linear, path, monkeypatch):
    """fp32 operands on CUDA run as three TF32 products per tile (both operands split in the tile, or the
    token operand split ahead): forward and both gradients within the tolerance rule of cuBLAS's fp32 ``mm``
    per group (TF32 off, the default), against fp64, at an expert layer's sizes; the second call makes no
    host sync (the per-group path reads ``offs`` on the host)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")
    monkeypatch.setenv("OPSMATH_FP32_GROUPED_GEMM", path)
    torch.manual_seed(3)
    x, dy = torch.randn(S, K), torch.randn(S, N)
    w = torch.randn(len(sizes), N, K).transpose(1, 2) if linear else torch.randn(len(sizes), K, N)
    w = w / K ** 0.5
    offs = _offs(sizes)
    xc, wc, dyc, oc = x.cuda(), w.cuda(), dy.cuda(), offs.cuda()
    got = _grads(lambda a, b: grouped_mm(a, b, oc), xc, wc, dyc)
    eager = _grads(lambda a, b: _per_group_mm(a, b, oc), xc, wc, dyc)
    ref = _grads(lambda a, b: _per_group_mm(a, b, offs), x.double(), w.double(), dy.double())
    end = sum(sizes)
    for name, g, e, r in zip(("y", "dx", "dw"), got, eager, ref):
        g, e = g.cpu(), e.cpu()
        if name != "dw":
            g, e, r = g[:end], e[:end], r[:end]
        assert_rule(g, e, r, atol=1e-6, name=name)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_mm(xc, wc, oc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setenv("OPSMATH_FP32_GROUPED_GEMM", "mm")
    torch.testing.assert_close(grouped_mm(xc, wc, oc).cpu()[:end], eager[0].cpu()[:end])


def test_tiles_that_overflow_a_blocks_shared_memory_are_left_out(monkeypatch):
    """fp32 doubles the operand buffers: the forward's 128x256x64 tile (3 stages, 288 KiB) does not fit an
    sm_90 block's 227 KiB and is never launched there (Triton refuses it); the weight gradient's tiles and
    every 16-bit tile fit."""
    from types import SimpleNamespace
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(shared_memory_per_block_optin=232448))

    def like(size):
        return SimpleNamespace(is_cuda=True, device="cuda:0", element_size=lambda: size)
    assert set(gm.FWD_TILES) - set(gm.fitting(gm.FWD_TILES, like(4), wgrad=False)) == {"128x256x64w8s3"}
    assert gm.fitting(gm.WGRAD_TILES, like(4), wgrad=True) == gm.WGRAD_TILES
    assert gm.fitting(gm.FWD_TILES, like(2), wgrad=False) == gm.FWD_TILES


def test_fp32_takes_the_triton_kernels_only_on_gpus_with_tf32_tensor_cores(monkeypatch):
    """sm_80 and newer: the Triton kernels (``tf32x3``); a Turing or Volta card, or the CPU, or
    ``OPSMATH_FP32_GROUPED_GEMM=mm``: one ``mm`` per group."""
    from types import SimpleNamespace
    cuda = SimpleNamespace(is_cuda=True, device="cuda:0")
    for capability, want in (((9, 0), True), ((8, 0), True), ((7, 5), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert gm.fp32_on_triton(cuda) is want, capability
    monkeypatch.setenv("OPSMATH_FP32_GROUPED_GEMM", "mm")
    assert not gm.fp32_on_triton(cuda)
    assert not gm.fp32_on_triton(torch.zeros(1))


def test_fp32_splits_the_token_rows_ahead_by_default_on_sm90_only(monkeypatch):
    """The split-ahead path (``grouped_mm_split.py``) is the default on sm_90, where it was measured;
    ``tf32x3`` elsewhere (sm_80, sm_100, the CPU); ``OPSMATH_FP32_GROUPED_GEMM`` picks either everywhere."""
    from types import SimpleNamespace
    monkeypatch.delenv("OPSMATH_FP32_GROUPED_GEMM", raising=False)
    cuda = SimpleNamespace(is_cuda=True, device="cuda:0")
    for capability, want in (((9, 0), "split"), ((8, 0), "tf32x3"), ((10, 0), "tf32x3")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert gm.fp32_path(cuda) == want, capability
    assert gm.fp32_path(torch.zeros(1)) == "tf32x3"
    monkeypatch.setenv("OPSMATH_FP32_GROUPED_GEMM", "tf32x3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert gm.fp32_path(cuda) == "tf32x3"
