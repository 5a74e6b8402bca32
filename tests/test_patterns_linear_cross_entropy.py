"""The linear_cross_entropy rewrite: LM-head spellings fused (loss and grads equal eager), and the
cases that must keep their logits declined with a reason."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opsmath

B, T, C, V = 2, 9, 16, 37


class Head(nn.Module):
    def __init__(self, spelling, bias=False):
        super().__init__()
        self.proj = nn.Linear(C, C)
        self.lm_head = nn.Linear(C, V, bias=bias)
        self.spelling = spelling

    def forward(self, x, t):
        h = self.proj(x)
        s = self.spelling
        if s == "nanogpt":        # logits.view(-1, V), targets.view(-1), ignore_index=-1
            logits = self.lm_head(h)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1), ignore_index=-1)
        if s == "llama_float":    # .float() before the loss, HF-style shift, reduction sum / count
            logits = self.lm_head(h).float()
            sl, st = logits[:, :-1].contiguous(), t[:, 1:].contiguous()
            return F.cross_entropy(sl.view(-1, V), st.view(-1), reduction="sum") / st.numel()
        if s == "flat_input":     # rows flattened before the head, label smoothing
            return F.cross_entropy(self.lm_head(h.reshape(-1, C)), t.reshape(-1), label_smoothing=0.1)
        if s == "returns_logits":     # HF: the output carries the logits and the loss
            logits = self.lm_head(h)
            return logits, F.cross_entropy(logits.float().view(-1, V), t.view(-1))
        if s == "returns_sliced_logits":
            logits = self.lm_head(h)
            return logits, F.cross_entropy(logits[:, :-1].reshape(-1, V), t[:, 1:].reshape(-1))
        if s == "gemma2_softcap":     # HF Gemma-2: logits / c, tanh, * c, returned; the loss on their fp32 copy
            logits = torch.tanh(self.lm_head(h) / 3.0) * 3.0
            return logits, F.cross_entropy(logits.float().view(-1, V), t.view(-1))
        if s == "softcap_mul":        # c * tanh(z * (1 / c)), shifted rows, the loss alone
            logits = 2.5 * torch.tanh(self.lm_head(h) * (1 / 2.5))
            return F.cross_entropy(logits[:, :-1].reshape(-1, V), t[:, 1:].reshape(-1), label_smoothing=0.1)
        if s == "softcap_raw_read":   # the uncapped logits are read too: they must exist
            z = self.lm_head(h)
            return z.mean(), F.cross_entropy((torch.tanh(z / 3.0) * 3.0).view(-1, V), t.view(-1))
        if s == "tanh_not_a_cap":     # 2 * tanh(z / 3): not a softcap
            return F.cross_entropy((torch.tanh(self.lm_head(h) / 3.0) * 2.0).view(-1, V), t.view(-1))
        if s == "class_dim_1":    # (B, V, T) input
            return F.cross_entropy(self.lm_head(h).transpose(1, 2), t)
        if s == "reduction_none":
            return F.cross_entropy(self.lm_head(h).view(-1, V), t.view(-1), reduction="none").mean()
        if s == "class_weights":
            return F.cross_entropy(self.lm_head(h).view(-1, V), t.view(-1), weight=torch.ones(V, device=h.device))
        raise ValueError(s)


def run(spelling, bias=False, amp=False, logits_loss=False):
    torch.manual_seed(0)
    ref = Head(spelling, bias)
    model = opsmath.optimize(copy.deepcopy(ref))
    x = torch.randn(B, T, C)
    t = torch.randint(0, V, (B, T))
    t[0, :3] = -1 if spelling == "nanogpt" else -100
    outs = []
    for m in (model, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = m(x, t)
        loss = out[1] if isinstance(out, tuple) else out
        if logits_loss:   # a second loss on the returned logits: its gradient must flow through the op
            loss = loss + 1e-2 * torch.logsumexp(out[0].float(), -1).pow(2).mean()
        loss.backward()
        outs.append(loss)
    return model, ref, outs


@pytest.mark.parametrize("spelling,bias", [("nanogpt", False), ("llama_float", False), ("flat_input", True),
                                           ("returns_logits", True), ("gemma2_softcap", True),
                                           ("softcap_mul", False)])
def test_fused_spellings_match_eager(spelling, bias):
    model, ref, (loss, ref_loss) = run(spelling, bias)
    matches = [m for m in opsmath.report(model).graphs[0].matches if m.pattern == "linear_cross_entropy"]
    assert len(matches) == 1 and matches[0].details["compute_grad"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_autocast_keeps_the_bf16_matmul():
    model, ref, (loss, ref_loss) = run("nanogpt", amp=True)
    m = [m for m in opsmath.report(model).graphs[0].matches if m.pattern == "linear_cross_entropy"][0]
    assert m.details["dtype"] == "bfloat16"
    torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=1e-3)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert ((p.grad - q.grad).norm() / q.grad.norm()) < 2e-2


@pytest.mark.parametrize("spelling,reason", [
    ("returns_sliced_logits", "reads a slice"), ("class_dim_1", "only (tokens, classes)"),
    ("reduction_none", "reduction='none'"), ("class_weights", "class weights"),
    ("softcap_raw_read", "before the softcap are used elsewhere"), ("tanh_not_a_cap", "not come from a linear")])
def test_declines_keep_eager_and_say_why(spelling, reason):
    model, ref, (loss, ref_loss) = run(spelling)
    g = opsmath.report(model).graphs[0]
    assert not [m for m in g.matches if m.pattern == "linear_cross_entropy"]
    assert any(d.pattern == "linear_cross_entropy" and reason in d.reason for d in g.declines)
    torch.testing.assert_close(loss, ref_loss)


def test_inference_graph_computes_the_loss_only():
    torch.manual_seed(0)
    ref = Head("nanogpt").eval()
    model = opsmath.optimize(copy.deepcopy(ref))
    x, t = torch.randn(B, T, C), torch.randint(0, V, (B, T))
    with torch.no_grad():
        loss = model(x, t)
    m = [m for m in opsmath.report(model).graphs[0].matches if m.pattern == "linear_cross_entropy"][0]
    assert not m.details["compute_grad"]
    torch.testing.assert_close(loss, ref(x, t), rtol=1e-5, atol=1e-6)


def test_returned_logits_equal_eager_and_carry_their_gradient():
    model, ref, (loss, ref_loss) = run("returns_logits", bias=True, logits_loss=True)
    m = [m for m in opsmath.report(model).graphs[0].matches if m.pattern == "linear_cross_entropy"][0]
    assert m.details["returns_logits"] and "logits returned" in m.replacement
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    torch.manual_seed(3)
    x, t = torch.randn(B, T, C), torch.randint(0, V, (B, T))
    torch.testing.assert_close(model(x, t)[0], ref(x, t)[0], rtol=1e-5, atol=1e-5)


class LossOnly(nn.Module):
    """The loss on logits the graph receives (Hugging Face GPT-2's second graph): cross_entropy alone."""

    def forward(self, logits, t):
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), t.view(-1), label_smoothing=0.05)


def test_cross_entropy_on_given_logits_reads_them_in_their_dtype():
    torch.manual_seed(0)
    model = opsmath.optimize(LossOnly())
    logits = torch.randn(B, T, V, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (B, T))
    t[0, :2] = -100
    loss = model(logits, t)
    loss.backward()
    g = opsmath.report(model).graphs[0]
    m = [m for m in g.matches if m.pattern == "cross_entropy"]
    assert len(m) == 1 and "read in bfloat16" in m[0].replacement
    assert "aten.to" not in g.after_code            # the fp32 copy of the logits is gone
    ref_logits = logits.detach().clone().requires_grad_()
    ref = LossOnly()(ref_logits, t)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), rtol=1e-2, atol=1e-4)


def test_linear_heads_stay_with_linear_cross_entropy():
    model, _, _ = run("nanogpt")
    patterns = [m.pattern for m in opsmath.report(model).graphs[0].matches]
    assert "linear_cross_entropy" in patterns and "cross_entropy" not in patterns


@pytest.mark.parametrize("amp", [False, True])
def test_softcapped_logits_returned_with_their_gradient(amp):
    """Gemma-2's final softcap goes into the op: the loss, every gradient (a second loss on the returned,
    capped logits included) and the logits themselves equal eager's."""
    model, ref, (loss, ref_loss) = run("gemma2_softcap", bias=True, amp=amp, logits_loss=True)
    m = [m for m in opsmath.report(model).graphs[0].matches if m.pattern == "linear_cross_entropy"][0]
    assert m.details["softcap"] == 3.0 and "softcap=3" in m.replacement and m.details["returns_logits"]
    tol = dict(rtol=2e-3, atol=1e-3) if amp else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, **tol)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert ((p.grad - q.grad).norm() / q.grad.norm()) < (2e-2 if amp else 1e-5)
    torch.manual_seed(3)
    x, t = torch.randn(B, T, C), torch.randint(0, V, (B, T))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        got, want = model(x, t)[0], ref(x, t)[0]
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), **(dict(rtol=2e-2, atol=2e-2) if amp else tol))
