"""fp32 grouped GEMMs with the token operand split ahead (``src/opsmath/kernels/grouped_mm_split.py``): the
split itself, then forward and both gradients through ``opsmath::grouped_mm`` against fp64 per-group
products, over several row chunks, with empty groups, a group cut by a chunk boundary, rows past the
last group and odd sizes. On the CPU (Triton's interpreter) the TF32 products are fp32 products, so
these check the indexing; ``test_kernel_grouped_mm.py`` checks the tolerance rule on the GPU."""
import pytest
import torch

from opsmath.kernels import grouped_mm as gm
from opsmath.kernels import grouped_mm_split as gs
from opsmath.kernels.grouped_mm import grouped_mm, reference


def _tf32(v: torch.Tensor) -> torch.Tensor:
    return ((v.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)


def test_split_is_tf32_hi_and_lo_in_either_layout(triton_on_cpu, device):
    torch.manual_seed(0)
    x = torch.randn(150, 70) * torch.logspace(-20, 20, 70)
    for transposed in (False, True):
        hi, lo = torch.empty(100 * 70, device=device), torch.empty(100 * 70, device=device)
        gs.split_rows(x.to(device), 30, 130, hi, lo, transposed)
        shape = (70, 100) if transposed else (100, 70)
        hi, lo = hi.cpu().view(shape), lo.cpu().view(shape)
        hi, lo = (hi.t(), lo.t()) if transposed else (hi, lo)
        v = x[30:130]
        assert torch.equal(hi, _tf32(v)), transposed
        assert torch.equal(lo, _tf32(v - _tf32(v))), transposed
        assert ((hi.view(torch.int32) & 0x1FFF) == 0).all() and ((lo.view(torch.int32) & 0x1FFF) == 0).all()
        assert ((hi + lo - v).abs() <= v.abs() * 2.0 ** -21).all(), "hi + lo keeps 21 bits of every value"


@pytest.mark.parametrize("linear", [False, True])
@pytest.mark.parametrize("tile", range(len(gs.FWD_TILES)))
def test_split_ahead_grouped_mm_matches_per_group_products(tile, linear, triton_on_cpu, device, monkeypatch):
    """``OPSMATH_FP32_GROUPED_GEMM=split`` where the op would take tf32x3: rows in chunks of 128 (a group
    cut by chunk boundaries, chunks a group has no row in), each tile the tuner may pick (forced)."""
    from opsmath.kernels._common import forced_row_config
    monkeypatch.setattr(gm, "TRITON_DTYPES", (torch.float32,))
    monkeypatch.setattr(gm, "precision", lambda x: "tf32x3")   # what CUDA's fp32 takes without TF32
    monkeypatch.setenv("OPSMATH_FP32_GROUPED_GEMM", "split")
    monkeypatch.setattr(gs, "SPLIT_BYTES", 128 * 150 * 4)   # 128 rows a chunk at 140 or 150 columns
    torch.manual_seed(tile)
    sizes = [3, 0, 190, 0, 50, 1]
    S, K, N = 260, 140, 150   # two column blocks of 128 in every GEMM: the swizzled program order
    x, dy, offs = torch.randn(S, K), torch.randn(S, N), torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    w = torch.randn(len(sizes), N, K).transpose(1, 2) if linear else torch.randn(len(sizes), K, N)
    xd, wd = x.to(device).requires_grad_(), w.to(device).requires_grad_()
    with forced_row_config(tile):
        y = grouped_mm(xd, wd, offs.to(device))
        y.backward(dy.to(device))
    got = [y.detach().cpu(), xd.grad.cpu(), wd.grad.cpu()]
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    yr = reference(xr, wr, offs).double()
    ref = [yr, *torch.autograd.grad(yr, (xr, wr), dy.double())]
    end = sum(sizes)
    for g, r, name in zip(got, ref, ("y", "dx", "dw")):
        g, r = (g[:end], r[:end]) if name != "dw" else (g, r)
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4, msg=name)
    assert torch.equal(got[0][end:], torch.zeros(S - end, N)), "rows past the last group are zero"
    assert all(got[2][g].abs().max() == 0 for g, s in enumerate(sizes) if s == 0), "an empty group's dw is zero"
    assert wd.grad.stride() == wd.stride()


def test_chunks_hold_split_bytes_and_whole_tiles(monkeypatch):
    monkeypatch.setattr(gs, "SPLIT_BYTES", 32 << 20)
    assert gs.chunk_rows(16384, 5632) == 1408            # 32 MiB / (5632 x 4 B) = 1489 rows, down to 128s
    assert gs.chunk_rows(16384, 2048) == 4096
    assert gs.chunk_rows(100, 2048) == 100
    assert gs.chunk_rows(16384, 1 << 20) == 128          # at least one row tile


def test_tiles_that_overflow_shared_memory_are_left_out(monkeypatch):
    from types import SimpleNamespace
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(shared_memory_per_block_optin=232448))
    cuda = SimpleNamespace(is_cuda=True, device="cuda:0")
    assert all(gs.shared_fits(t, False, cuda) for t in gs.FWD_TILES.values())
    assert all(gs.shared_fits(t, True, cuda) for t in gs.WGRAD_TILES.values())
    assert not gs.shared_fits((256, 128, 32, 8, 3), False, cuda)    # 3 x 80 KiB
    assert not gs.shared_fits((32, 128, 128, 8, 5), True, cuda)     # 5 x 48 KiB
