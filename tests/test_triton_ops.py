"""opsmath's Triton-backed ops under Inductor: a ``triton_op`` is traced into, so the compiled step launches
its kernels from Inductor's generated code (no custom-op dispatch in Python per call), and computes what
the op computes when called op by op. GPU only: on CPU the ops trace to their PyTorch reference."""
import pytest
import torch

from opsmath.kernels.attention import attention_op
from opsmath.kernels.attention.tuning import eager_same_dtype
from tolerance import assert_rule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _fwd_bwd(fn, inputs, weight):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out.float() * weight).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("window,softcap,masked", [(0, 0.0, False), (96, 0.0, False), (0, 30.0, False), (0, 0.0, True)],
                         ids=["causal", "window", "softcap", "bool-mask"])
def test_attention_kernels_launch_from_inductor_code_and_match(window, softcap, masked):
    """A bool padding mask reaches the kernels as bytes (torch 2.11's Inductor cannot lower a bool bitcast)."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(window)
    B, H, Hkv, S, D = 2, 4, 2, 333, 64   # GQA, a length no tile divides
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weight = torch.randn(B, H, S, D, device="cuda")
    mask = (torch.arange(S, device="cuda") >= torch.tensor([S, S - 100], device="cuda")[:, None])[:, None, None]
    mask = mask if masked else None   # (B, 1, 1, S): the second row's last 100 keys padded

    def op(q, k, v):
        return attention_op(q, k, v, None, mask, float("-inf"), True, D ** -0.5, 0.0, None, softcap, window)[0]

    torch._dynamo.reset()
    compiled = torch.compile(op, backend="inductor")
    got, codes = run_and_get_code(lambda: _fwd_bwd(compiled, (q, k, v), weight))
    code = "\n".join(codes)
    assert "_attn_fwd" in code and "_attn_bwd_dq" in code and "_attn_bwd_dkdv" in code, "kernels not inlined"
    assert "opsmath.attention" not in code, "the compiled code still dispatches the custom op"
    by_op = _fwd_bwd(op, (q, k, v), weight)

    def eager(q, k, v):
        return eager_same_dtype(q, k, v, None, mask, float("-inf"), True, D ** -0.5, 0.0, 0, softcap=softcap,
                                window=window)
    same = _fwd_bwd(eager, (q, k, v), weight)
    ref = _fwd_bwd(eager, (q.double(), k.double(), v.double()), weight.double())
    for name, a, b, s, r in zip(("out", "dq", "dk", "dv"), got, by_op, same, ref):
        assert_rule(a, s, r, name=name)
        assert_rule(b, s, r, name=name + " op by op")
