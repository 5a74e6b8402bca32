"""The attention family's pass after matching (``src/opsmath/patterns/attention/backend.py``): the backend each
emitted ``opsmath::attention`` runs is chosen once every rule has applied."""
import copy
import math

import pytest
import torch
import torch.nn as nn

import opsmath


@pytest.mark.parametrize("padding", [False, True])
def test_backend_is_chosen_after_matching_and_may_swap_in_sdpa(monkeypatch, padding):
    """Matching always emits ``opsmath::attention``; the pass after matching asks the tuner, and where a
    vendor backend wins (forced here: the CPU tuner always answers "opsmath") the op becomes that SDPA
    call, mask folded into its bias, with the report saying so; the step still equals eager."""
    from opsmath.patterns.attention import backend as _attention_backend
    asked = []

    def tuner(q, k, bias_shape, mask_shape, *rest):
        asked.append((tuple(q.shape), mask_shape))
        return "sdpa_flash"
    monkeypatch.setattr(_attention_backend, "backend_for", tuner)
    torch.manual_seed(0)
    B, H, S, Dh = 2, 3, 9, 4
    D = H * Dh

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(D, 3 * D)

        def forward(self, x, keep):
            q, k, v = (t.view(B, S, H, Dh).transpose(1, 2) for t in self.proj(x).split(D, -1))
            att = q @ k.transpose(-2, -1) / math.sqrt(Dh)
            if padding:
                att = att.masked_fill(~keep[:, None, None, :], float("-inf"))
            return (att.softmax(-1) @ v).sum()
    ref = Attn()
    model = copy.deepcopy(ref)
    x = torch.randn(B, S, D)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, -3:] = False
    opt = opsmath.optimize(model, inductor=False)
    out, expect = opt(x, keep), ref(x, keep)
    out.backward()
    expect.backward()
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    rep = opsmath.report(opt)
    (m,) = [m for m in rep.matches if m.pattern == "attention"]
    assert asked and m.details["backend"] == "sdpa_flash"
    assert m.replacement.startswith("sdpa_flash(") and m.replacement.endswith("measured fastest")
    assert "opsmath.attention" not in rep.graphs[0].after_ops


def test_where_no_kernel_runs_on_the_gpu_the_tuner_answers_math(monkeypatch):
    """Every candidate failing (opsmath's kernel in every block configuration, e.g. for want of shared
    memory on a smaller GPU, and every SDPA backend) is no reason to emit a kernel that cannot launch:
    the tuner answers "math". Any other tuning failure still answers opsmath's kernel."""
    from types import SimpleNamespace
    from opsmath.kernels.attention import tuning
    from opsmath.kernels.autotune import AllCandidatesFailed
    q = SimpleNamespace(device=torch.device("cuda"), shape=(1, 2, 8, 16), dtype=torch.bfloat16)

    def none_ran(*a, **kw):
        raise AllCandidatesFailed("every candidate failed", {"opsmath": "OutOfResources: shared memory"})
    monkeypatch.setattr(tuning, "choose", none_ran)
    assert tuning.backend_for(q, q, None, None, float("-inf"), True, 0.25, 0.0, False) == "math"

    def broken(*a, **kw):
        raise RuntimeError("CUDA out of memory while tuning")
    monkeypatch.setattr(tuning, "choose", broken)
    assert tuning.backend_for(q, q, None, None, float("-inf"), True, 0.25, 0.0, False) == "opsmath"


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_math_backend_computes_the_attention_as_written(monkeypatch, name):
    """The "math" backend (no kernel ran on the GPU): HF LLaMA (GQA, causal) and Gemma-2 (softcap, sliding
    window) train as eager, and the report says what ran."""
    transformers = pytest.importorskip("transformers")
    from opsmath.patterns.attention import backend as _attention_backend
    monkeypatch.setattr(_attention_backend, "backend_for", lambda *a, **kw: "math")
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=128)
    cfg = transformers.LlamaConfig(**small) if name == "llama" else transformers.Gemma2Config(
        **small, head_dim=16, sliding_window=8, attn_logit_softcapping=50.0)
    torch.manual_seed(0)
    model = getattr(transformers, "LlamaForCausalLM" if name == "llama" else "Gemma2ForCausalLM")(cfg)
    ref, ids = copy.deepcopy(model), torch.randint(0, 128, (2, 16))
    opt = opsmath.optimize(model, inductor=False)
    out, expect = opt(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    out.backward()
    expect.backward()
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    matches = [m for m in opsmath.report(opt).matches if m.pattern == "attention"]
    assert len(matches) == 2 and all(m.details["backend"] == "math" for m in matches)
    assert all(m.replacement.startswith("attention as written (") for m in matches)
    assert all("opsmath.attention" not in g.after_ops for g in opsmath.report(opt).graphs)
