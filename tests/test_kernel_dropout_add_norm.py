"""opsmath::dropout_add_norm kernel: Triton vs PyTorch's own LayerNorm / RMSNorm, docs/design.md rule."""
import pytest
import torch
import torch.nn.functional as F

from opsmath.kernels._common import dropout_keep, flat_offsets
from opsmath.kernels.dropout_add_norm import dropout_add_norm_op
from tolerance import assert_rule

from conftest import DEVICE


def eager(x, r, w, b, is_rms, eps, p, seed, out_dtype):
    """residual + dropout(x) -> F.layer_norm / hand-written RMSNorm, in the inputs' dtype."""
    if p > 0:
        x = x * dropout_keep(seed, flat_offsets(x.shape, x.device), p) / (1 - p)
    h = r + x
    if is_rms:
        hf = h.to(torch.promote_types(h.dtype, torch.float32))
        y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
        y = y * w if w is not None else y
    else:
        y = F.layer_norm(h, (h.shape[-1],), w, b, eps)
    return y.to(out_dtype), h


def fused(x, r, w, b, is_rms, eps, p, seed, out_dtype):
    out, h, _ = dropout_add_norm_op(x, r, w, b, is_rms, eps, p, torch.tensor(seed), out_dtype)
    return out, h


CASES = [  # rows, width, rms, p, affine, residual used later
    ((5, 37), False, 0.0, True, False),
    ((2, 7, 64), True, 0.3, True, True),
    ((3, 100), False, 0.5, False, True),
    ((9, 33), True, 0.0, False, False),
    ((4, 3, 129), False, 0.1, True, True),
    ((301, 130), True, 0.2, True, False),     # 19 tiles of 16 rows over 4 programs: the strided tile loop
    ((150, 1000), False, 0.1, True, True),    # 4 rows per tile, a partial last tile
]
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
PAIRS = [(c, dt) for c in CASES for dt in DTYPES]
if DEVICE == "cuda":  # widths of real models, bf16
    PAIRS += [(((4096, n), rms, 0.1, True, True), torch.bfloat16) for n in (768, 1024, 4096, 8192)
              for rms in (False, True)]


def _run(fn, case, dtype, device, seed=11):
    shape, rms, p, affine, h_used = case
    torch.manual_seed(0)
    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    r = torch.randn(shape, device=device).to(dtype).requires_grad_()
    n = shape[-1]
    w = (torch.randn(n, device=device).to(dtype).requires_grad_()) if affine else None
    b = (torch.randn(n, device=device).to(dtype).requires_grad_()) if affine and not rms else None
    out, h = fn(x, r, w, b, rms, 1e-5, p, seed, dtype)
    loss = (out.float() * torch.linspace(-1, 1, n, device=device)).sum()
    if h_used:
        loss = loss + (h.float() ** 2).sum() * 0.1
    loss.backward()
    return [out.detach(), h.detach(), x.grad, r.grad] + [t.grad for t in (w, b) if t is not None]


@pytest.mark.parametrize("case,dtype", PAIRS, ids=str)
def test_triton_matches_eager(case, dtype, triton_on_cpu, device):
    f = _run(fused, case, dtype, device)
    e = _run(eager, case, dtype, device)
    ref = _run(eager, case, torch.float64, device)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, b, c in zip(["out", "h", "dx", "dresidual", "dweight", "dbias"], f, e, ref):
        assert_rule(a, b, c, atol=atol, name=f"{name} {dtype}")


@pytest.mark.parametrize("case", [CASES[-1], ((9, 200), True, 0.3, True, True)], ids=str)
def test_every_tuning_candidate_matches_eager(case, triton_on_cpu, device, monkeypatch):
    """Each launch configuration the tuner may pick, forced in turn: rows per tile in the forward
    (``dropout_add_norm._configs``), rows per tile and programs per SM in the backward (``_bwd_configs``)."""
    from opsmath.kernels import dropout_add_norm as dan
    e, ref = _run(eager, case, torch.float32, device), _run(eager, case, torch.float64, device)
    N = case[0][-1]
    for i in range(max(len(dan._configs(N)), len(dan._bwd_configs(N)))):
        picked = []

        def pick(op, key, configs, run, device):
            picked.append(list(configs.values())[i % len(configs)])
            return picked[-1]
        monkeypatch.setattr(dan, "tuned_config", pick)
        for name, a, b, c in zip(["out", "h", "dx", "dresidual", "dweight", "dbias"],
                                 _run(fused, case, torch.float32, device), e, ref):
            assert_rule(a, b, c, atol=1e-5, name=f"{name} configs {picked}")


@pytest.mark.parametrize("case", CASES[:5], ids=str)
def test_reference_matches_autograd(case):
    f = _run(fused, case, torch.float64, "cpu")
    e = _run(eager, case, torch.float64, "cpu")
    for a, b in zip(f, e):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_dropout_fraction_and_mask_reused_in_backward(triton_on_cpu, device):
    """Fraction dropped within 0.01 of p; dx is zero exactly where forward dropped."""
    p = 0.3
    x = torch.ones(64, 512, device=device, requires_grad=True)
    r = torch.zeros(64, 512, device=device)
    out, h, _ = dropout_add_norm_op(x, r, None, None, True, 1e-5, p, torch.tensor(5), torch.float32)
    dropped = (h == 0)
    assert abs(dropped.float().mean().item() - p) <= 0.01
    out.sum().backward()
    assert torch.equal(x.grad == 0, dropped)


def test_opcheck():
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    w, b = torch.randn(8), torch.randn(8)
    torch.library.opcheck(torch.ops.opsmath.dropout_add_norm.default,
                          (x, r, w, b, False, 1e-5, 0.0, torch.tensor(0), torch.float32))


def test_opcheck_triton(triton_on_cpu):
    x, r = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    torch.library.opcheck(torch.ops.opsmath.dropout_add_norm.default,
                          (x, r, w, None, True, 1e-6, 0.2, torch.tensor(3), torch.float32))


def test_mismatched_dtypes_are_a_clear_error():
    with pytest.raises(ValueError, match="one dtype and shape"):
        dropout_add_norm_op(torch.randn(2, 4), torch.randn(2, 4, dtype=torch.float64), None, None, False,
                            1e-5, 0.0, torch.tensor(0), torch.float32)


def test_resident_programs_from_the_compiled_kernel(monkeypatch):
    """The backward's one-wave grid: programs per SM = what the register file, shared memory and warp
    slots allow for the compiled kernel (the sm_90 build: 72 registers x 128 threads -> 7 on an H200); anything
    unreadable falls back to the fixed grid."""
    from types import SimpleNamespace

    import triton.runtime
    from opsmath.kernels._common import resident_programs
    props = {"max_num_regs": 65536, "warpSize": 32, "max_shared_mem": 232448, "multiprocessor_count": 132}
    fake_driver = SimpleNamespace(active=SimpleNamespace(utils=SimpleNamespace(get_device_properties=lambda i: props)))
    monkeypatch.setattr(triton.runtime, "driver", fake_driver)

    def kernel(regs, shared):
        compiled = SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(shared=shared), _init_handles=lambda: None)
        return SimpleNamespace(warmup=lambda *a, grid, **k: compiled)
    cuda = torch.device("cuda", 0)
    assert resident_programs(kernel(72, 1024), (), dict(num_warps=4), cuda) == 7
    assert resident_programs(kernel(98, 1024), (), dict(num_warps=16), cuda) == 1
    assert resident_programs(kernel(32, 0), (), dict(num_warps=4), cuda) == 16      # warp slots: 64 / 4
    assert resident_programs(kernel(32, 100_000), (), dict(num_warps=4), cuda) == 2  # shared memory
    broken = SimpleNamespace(warmup=lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no GPU")))
    assert resident_programs(broken, (), {}, cuda) == 4
    assert resident_programs(kernel(72, 0), (), {}, torch.device("cpu")) == 4
