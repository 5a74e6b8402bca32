"""The table_gather family: a small table read by many indices (T5's relative position bias) becomes
``opsmath::table_gather``, whose backward sums each row's gradient without atomics. The kernel against
fp64 sums on odd sizes (Triton's interpreter on CPU), the rewrite on a bias module and on HF T5, and the
embeddings it leaves alone."""
import copy

import pytest
import torch
import torch.nn as nn

import opsmath
from opsmath.kernels import table_gather as tg
from tolerance import assert_rule, optimized_matches_eager, rel_err


@pytest.mark.parametrize("R,C,N", [(32, 4, 2000), (5, 3, 63), (100, 33, 777), (1, 7, 300), (70, 16, 129)])
def test_row_sums_follow_the_tolerance_rule(R, C, N, triton_on_cpu, device):
    torch.manual_seed(R + C + N)
    dy = torch.randn(N, C, device=device)
    idx = torch.randint(0, R, (N,), device=device)
    ref = torch.zeros(R, C, dtype=torch.float64, device=device).index_add_(0, idx, dy.double())
    eager = torch.zeros(R, C, device=device).index_add_(0, idx, dy)
    assert_rule(tg.table_gather_backward_op(dy, idx, R, torch.float32), eager, ref, name=f"{R}x{C} by {N}")


def test_op_trains_as_embedding_in_bf16(triton_on_cpu, device):
    """bf16 table: the gather is exact, the row sums in fp32 then rounded, within the rule of eager's."""
    torch.manual_seed(0)
    table = torch.randn(24, 8, device=device)
    idx = torch.randint(0, 24, (40, 37), device=device)
    dy = torch.randn(40, 37, 8, device=device)
    grads = []
    for fn, dt in ((tg.table_gather, torch.bfloat16), (lambda t, i: nn.functional.embedding(i, t), torch.bfloat16),
                   (lambda t, i: nn.functional.embedding(i, t), torch.float64)):
        t = table.to(dt).requires_grad_()
        y = fn(t, idx)
        assert torch.equal(y.double(), nn.functional.embedding(idx, t.detach()).double())
        y.backward(dy.to(dt))
        grads.append(t.grad)
    assert_rule(*grads, atol=1e-2, name="bf16 table gradient")


class RelativeBias(nn.Module):
    """Scores plus a learned bias per (bucket, head), the bucket a function of the distance (T5's spelling)."""

    def __init__(self, T=48, heads=4, buckets=16):
        super().__init__()
        self.bias = nn.Embedding(buckets, heads)
        pos = torch.arange(T)
        self.register_buffer("bucket", (pos[None, :] - pos[:, None]).abs().clamp(max=buckets - 1))
        self.proj = nn.Linear(heads, heads)

    def forward(self, x):                       # x (B, heads, T, T)
        bias = self.bias(self.bucket).permute(2, 0, 1).unsqueeze(0)
        return self.proj((x + bias).softmax(-1).transpose(1, 3))


def test_a_relative_bias_is_rewritten_and_trains_as_eager():
    torch.manual_seed(0)
    rep = optimized_matches_eager(RelativeBias(), torch.randn(2, 4, 48, 48))
    m = [m for m in rep.matches if m.pattern == "table_gather"]
    assert len(m) == 1 and m[0].details == dict(rows=16, width=4, lookups=48 * 48), rep.render(width=120)


@pytest.mark.parametrize("module,reason", [
    (nn.Embedding(16, 4, padding_idx=0), "padding_idx"),
    (nn.Embedding(16, 4, scale_grad_by_freq=True), "padding_idx"),
    (nn.Embedding(4096, 4), None),                      # a token embedding: fewer lookups than 64 per row
    (nn.Embedding(72, 4), None),                        # more rows than the one-hot products pay for
])
def test_embeddings_it_leaves_alone(module, reason):
    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = module

        def forward(self, idx):
            return self.emb(idx).sum(-1)
    torch.manual_seed(0)
    idx = torch.randint(0, 16, (96, 96))
    rep = optimized_matches_eager(Lookup(), idx)
    assert not [m for m in rep.matches if m.pattern == "table_gather"]
    declines = [d for d in rep.declines if d.pattern == "table_gather"]
    assert (reason in declines[0].reason) if reason else not declines


@pytest.mark.parametrize("name,per_layer", [("T5", 1), ("UMT5", 2)])
def test_hugging_face_t5_position_bias_is_rewritten_and_trains_as_eager(name, per_layer, device):
    """T5's encoder and decoder buckets (64 x 64 and 48 x 48 pairs into 32 rows; UMT5: a table per layer):
    all rewritten, loss and every gradient as eager's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{name}Config")(d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
                                                 num_decoder_layers=2, vocab_size=100, dropout_rate=0.0,
                                                 decoder_start_token_id=0)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(cfg).to(device)
    eager, opt = copy.deepcopy(model), opsmath.optimize(model)
    ids, labels = torch.randint(1, 100, (2, 64), device=device), torch.randint(1, 100, (2, 48), device=device)
    losses = [m(input_ids=ids, labels=labels).loss for m in (opt, eager)]
    for loss in losses:
        loss.backward()
    assert rel_err(losses[0].detach(), losses[1].detach()) < 1e-6
    for (name, p), q in zip(opt.named_parameters(), eager.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-5, name
    rows = [m.details for m in opsmath.report(opt).matches if m.pattern == "table_gather"]
    assert sorted(d["lookups"] for d in rows) == [48 * 48] * per_layer + [64 * 64] * per_layer, rows


def test_t5_at_changing_lengths_keeps_the_rewrite_in_its_dynamic_graph():
    """After the second length the encoder's sizes are symbolic (as under torch.compile): the one dynamic
    graph still takes the bias table (judged at the lengths seen at its capture), and every later length
    trains as eager, a length with fewer lookups than the threshold (20 x 20 into 8 rows) included."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=1, num_decoder_layers=1,
                                vocab_size=100, dropout_rate=0.0, decoder_start_token_id=0,
                                relative_attention_num_buckets=8)
    model = transformers.T5ForConditionalGeneration(cfg)
    eager, opt = copy.deepcopy(model), opsmath.optimize(model)
    for T in (40, 48, 56, 20):
        ids, labels = torch.randint(1, 100, (2, T)), torch.randint(1, 100, (2, 24))
        losses = [m(input_ids=ids, labels=labels).loss for m in (opt, eager)]
        for loss in losses:
            loss.backward()
        assert rel_err(losses[0].detach(), losses[1].detach()) < 1e-6, T
        for (name, p), q in zip(opt.named_parameters(), eager.parameters()):
            assert rel_err(p.grad, q.grad) < 1e-5, (T, name)
            p.grad, q.grad = None, None
    graphs = opsmath.report(opt).graphs
    assert [g.dynamic for g in graphs] == [False, True], [(g.dynamic, g.calls) for g in graphs]
    assert any(m.pattern == "table_gather" for m in graphs[1].matches), graphs[1].matches
