"""The experts rewrite with its first GEMMs reading the token rows through the routing index
(``opsmath::grouped_mm_gather``, opt-in: ``OPSMATH_GATHER_GEMM=1``, or ``auto``: measured on CUDA): every loop spelling trains like eager, the sorted copy of the tokens is no longer saved for
backward, and the Triton kernels (Triton's interpreter on CPU) train like eager too."""
import copy

import pytest
import torch

import opsmath
from opsmath import examples
from opsmath.kernels import grouped_mm as gm
from test_patterns_experts import OneHotLoop, StackedLoop, Top1Loop, _compare, _train_step
from tolerance import assert_rule


@pytest.fixture
def gather(monkeypatch):
    monkeypatch.setenv("OPSMATH_GATHER_GEMM", "1")


@pytest.mark.parametrize("make,shape,gathered", [
    (lambda: examples.SparseMoE(16, 24), (2, 8, 16), 2),              # x[tok]: both first GEMMs
    (OneHotLoop, (2, 7, 30), 1),                                       # HF's x[None, tok].reshape(-1, D)
    (lambda: StackedLoop(experts=range(2, 4)), (13, 16), 1),          # rows routed elsewhere (masked)
    (Top1Loop, (11, 16), 2),
])
def test_gathered_first_gemms_train_like_eager(make, shape, gathered, gather):
    torch.manual_seed(0)
    rep = _compare(make(), torch.randn(*shape))
    gemms = [m for m in rep.matches if m.pattern == "experts"][0].details["gemms"]
    assert gemms.count("opsmath::grouped_mm_gather") == gathered, gemms


def test_the_sorted_token_copy_is_not_saved_for_backward(monkeypatch):
    """Top-2 over 64 tokens of width 32: each first GEMM saved its [128, 32] fp32 input rows; gathered, the
    rows are read from the tokens backward keeps anyway (and an int64 index)."""
    saved = {}
    for forced in ("0", "1"):
        monkeypatch.setenv("OPSMATH_GATHER_GEMM", forced)
        torch._dynamo.reset()
        torch.manual_seed(0)
        opt = opsmath.optimize(examples.SparseMoE(32, 48))
        _train_step(opt, torch.randn(4, 16, 32))
        saved[forced] = opsmath.report(opt).graphs[0].saved_bytes[1]
    assert saved["0"] - saved["1"] >= 128 * 32 * 4, saved


def test_triton_gather_kernels_train_like_eager(gather, triton_on_cpu, device, monkeypatch):
    monkeypatch.setattr(gm, "TRITON_DTYPES", (torch.float32, torch.float16, torch.bfloat16))
    torch.manual_seed(0)
    model = examples.SparseMoE(16, 24, n_expert=3).to(device)
    x = torch.randn(2, 9, 16, device=device)
    eager, opt = copy.deepcopy(model), opsmath.optimize(copy.deepcopy(model), inductor=False)
    le, lo = _train_step(eager, x), _train_step(opt, x)
    torch.testing.assert_close(lo, le, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), opt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert "opsmath::grouped_mm_gather" in [m for m in opsmath.report(opt).matches][0].details["gemms"]


def test_fp8_experts_keep_their_sorted_rows(gather):
    """Under ``fp8=True`` the FP8 experts family takes grouped GEMMs over sorted rows: none is gathered."""
    torch.manual_seed(0)
    opt = opsmath.optimize(examples.SparseMoE(32, 64).to(torch.bfloat16), fp8=True)
    opt(torch.randn(2, 8, 32, dtype=torch.bfloat16)).float().sum().backward()
    gemms = [m for m in opsmath.report(opt).matches if m.pattern == "experts"][0].details["gemms"]
    assert gemms and "opsmath::grouped_mm_gather" not in gemms


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_hugging_face_grouped_experts_read_their_rows_through_the_index(bf16, gather):
    """Mixtral's default experts: ``hidden[perm // k]`` then ``torch._grouped_mm`` (bf16 weights) or the
    library's fallback (fp32, swapped for ``opsmath::grouped_mm``) become ``grouped_mm_gather``, once per
    layer; training equals eager (fp32: to the fused ops' rounding; bf16: the rule against fp32)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=100,
                                        num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(config)
    ids = torch.randint(0, 100, (2, 12))
    dt = torch.bfloat16 if bf16 else torch.float32
    ref, eager, opt = copy.deepcopy(model), copy.deepcopy(model).to(dt), opsmath.optimize(copy.deepcopy(model).to(dt))
    losses = [m(input_ids=ids, labels=ids).loss for m in (ref, eager, opt)]
    for loss in losses:
        loss.backward()
    rep = opsmath.report(opt)
    assert sum("grouped_mm_gather" in m.replacement for m in rep.matches) == 2, rep.render(width=140)
    for (name, r), e, o in zip(ref.named_parameters(), eager.parameters(), opt.parameters()):
        if bf16:
            assert_rule(o.grad.float(), e.grad.float(), r.grad.double(), atol=1e-2, name=name)
        else:
            torch.testing.assert_close(o.grad, e.grad, rtol=1e-4, atol=1e-6, msg=name)


class _AnyIndex(torch.nn.Module):
    """``torch._grouped_mm(x[idx], w, offs)`` with ``idx`` from the caller: nothing proves it in range (a
    negative index wraps in eager), so the gather stays eager's."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 16, 8, dtype=torch.bfloat16))

    def forward(self, x, idx, offs):
        return torch._grouped_mm(x[idx], self.w, offs=offs)


def test_a_gather_by_an_unproven_index_stays(gather):
    opt = opsmath.optimize(_AnyIndex())
    x, idx = torch.randn(5, 16, dtype=torch.bfloat16), torch.tensor([0, -1, 3, 3, 2, 4, 1, -5])
    y = opt(x, idx, torch.tensor([3, 8], dtype=torch.int32))
    assert not any("gather" in m.replacement for m in opsmath.report(opt).matches)
    torch.testing.assert_close(y, torch._grouped_mm(x[idx], opt.w, offs=torch.tensor([3, 8], dtype=torch.int32)))
