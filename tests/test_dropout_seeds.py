"""Dropout seeds (src/opsmath/kernels/_common.py): a rewritten graph draws every fused op's seed with one call on
the activations' device, the masks follow torch's RNG, and kernels read the seed from memory when
they run, so a CUDA graph replays with a fresh mask instead of the one it was captured with."""
import pytest
import torch
import torch.nn.functional as F

import opsmath
from opsmath.examples import gpt
from opsmath.kernels._common import dropout_keep, flat_offsets, new_seed, new_seeds

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _seed_nodes(model):
    graph = opsmath.report(model).graphs[0].graph.graph
    calls = [n for n in graph.nodes if n.op == "call_function"]
    return ([n for n in calls if n.target is new_seeds], [n for n in calls if n.target is new_seed],
            [n for n in calls if n.target is torch.ops.aten.select.int and n.args[0].target is new_seeds])


def test_one_draw_per_graph_for_every_fused_dropout():
    torch.manual_seed(0)
    model, batch = gpt(batch_size=2, seq_len=16, dropout=0.1)
    opt = opsmath.optimize(model)
    opt(*batch).backward()
    draws, singles, views = _seed_nodes(opt)
    ops = opsmath.report(opt).graphs[0].after_ops
    # each attention and each dropout-add-norm has dropout on: one seed each, all from one draw
    fused = ops["opsmath.attention"] + ops["opsmath.dropout_add_norm"]
    assert fused == 6 and len(draws) == 1 and not singles and len(views) == fused
    assert draws[0].args[1] == fused and draws[0].meta["val"].device.type == "cpu"
    assert sorted(v.args[2] for v in views) == list(range(fused))


def test_masks_follow_torch_rng():
    """The same torch seed gives the same loss; another seed other masks; eval draws nothing."""
    torch.manual_seed(0)
    model, batch = gpt(batch_size=2, seq_len=16, dropout=0.1)
    opt = opsmath.optimize(model)
    losses = []
    for s in (1, 1, 2):
        torch.manual_seed(s)
        losses.append(opt(*batch).item())
    assert losses[0] == losses[1] != losses[2]
    opt.eval()
    with torch.no_grad():
        opt(*batch)
    eval_graph = [g for g in opsmath.report(opt).graphs if not g.training][0].graph.graph
    assert not [n for n in eval_graph.nodes if n.target in (new_seeds, new_seed)]


def test_dropout_off_takes_no_seed_and_dropout_on_requires_one():
    """Without dropout the fused ops get None (no host tensor in the graph); with it a missing seed is
    a clear error, never an unseeded mask."""
    from opsmath.kernels.bias_gelu import bias_gelu_op
    torch.manual_seed(0)
    model, batch = gpt(batch_size=2, seq_len=16, dropout=0.0)
    opt = opsmath.optimize(model)
    opt(*batch).backward()
    graph = opsmath.report(opt).graphs[0].graph.graph
    fused = [n for n in graph.nodes if n.op == "call_function" and str(n.target).startswith("opsmath.")]
    assert fused and not [n for n in graph.nodes if n.target in (new_seeds, new_seed)]
    seed_at = [a.name for a in torch.ops.opsmath.attention.default._schema.arguments].index("seed")
    assert all(n.args[seed_at] is None for n in fused if n.target is torch.ops.opsmath.attention.default)
    with pytest.raises(ValueError, match="needs a seed"):
        bias_gelu_op(torch.randn(2, 3), torch.randn(3), "none", 0.1, None)


def test_seed_on_the_activation_device():
    x = torch.randn(3, 4)
    assert new_seed(x).device == x.device and new_seed(x).dim() == 0 and new_seed(x).dtype == torch.int64
    assert new_seeds(x, 5).shape == (5,)


def _ops_with_dropout(device, p=0.25):
    """(name, run(seed) -> output, reference(seed int) -> output) for each fused op with dropout."""
    from opsmath.kernels.attention import attention_op
    from opsmath.kernels.bias_gelu import bias_gelu_op
    from opsmath.kernels.dropout_add_norm import dropout_add_norm_op
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device)
    x, b = rnd(64, 96), rnd(96)
    r, w, nb = rnd(64, 96), rnd(96), rnd(96)
    q, k, v = rnd(1, 2, 80, 32), rnd(1, 2, 80, 32), rnd(1, 2, 80, 32)

    def gelu_ref(s):
        keep = dropout_keep(s, flat_offsets(x.shape, x.device), p)
        return F.gelu(x + b) * keep / (1 - p)

    def dan_ref(s):
        keep = dropout_keep(s, flat_offsets(x.shape, x.device), p)
        return F.layer_norm(r + x * keep / (1 - p), (96,), w, nb, 1e-5)

    def attn_ref(s):
        keep = dropout_keep(s, flat_offsets((1, 2, 80, 80), q.device), p)
        probs = torch.softmax(q @ k.transpose(-1, -2) * 32 ** -0.5, -1)
        return (probs * keep / (1 - p)) @ v
    return [("bias_gelu", lambda s: bias_gelu_op(x, b, "none", p, s), gelu_ref),
            ("dropout_add_norm", lambda s: dropout_add_norm_op(x, r, w, nb, False, 1e-5, p, s, x.dtype)[0], dan_ref),
            ("attention", lambda s: attention_op(q, k, v, None, None, float("-inf"), False, 32 ** -0.5, p, s)[0],
             attn_ref)]


@pytest.mark.parametrize("op", ["bias_gelu", "dropout_add_norm", "attention"])
def test_kernel_takes_the_seed_tensor_on_any_device(op, triton_on_cpu, device):
    """A seed given as a CPU tensor to an op on ``device`` (direct callers) gives the reference mask."""
    name, run, ref = [c for c in _ops_with_dropout(device) if c[0] == op][0]
    torch.testing.assert_close(run(torch.tensor(7)), ref(7), rtol=1e-4, atol=1e-4)


@cuda_only
@pytest.mark.parametrize("op", ["bias_gelu", "dropout_add_norm", "attention"])
def test_captured_cuda_graph_reads_the_seed_at_replay(op):
    """Capture an op with a device seed, change the seed in place, replay: the output is what the op
    gives for the new seed outside the graph, bit for bit (a seed baked into the launch would replay
    the captured mask)."""
    name, run, _ = [c for c in _ops_with_dropout("cuda") if c[0] == op][0]
    seed = torch.tensor(11, device="cuda")
    captured_mask_out = run(seed).clone()   # also compiles and tunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(seed)
    for s in (12, 13):
        seed.fill_(s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(torch.tensor(s, device="cuda")))
        assert not torch.equal(out, captured_mask_out)


class _Block(torch.nn.Module):
    """h = r + dropout(x), y = LayerNorm(h): both returned, so the mask is readable off h."""

    def __init__(self, n, p):
        super().__init__()
        self.drop, self.ln = torch.nn.Dropout(p), torch.nn.LayerNorm(n)

    def forward(self, x, r):
        h = r + self.drop(x)
        return h, self.ln(h)


@cuda_only
def test_optimized_model_in_a_cuda_graph_draws_fresh_masks():
    """The rewritten graph's seed draw is captured as a graph-safe random kernel: two replays of one
    captured forward give different dropout masks, both at the rate asked for."""
    torch.manual_seed(0)
    opt = opsmath.optimize(_Block(256, 0.3).cuda(), inductor=False)
    x, r = torch.randn(128, 256, device="cuda") + 3.0, torch.zeros(128, 256, device="cuda")
    for _ in range(2):
        opt(x, r)
    assert opsmath.report(opt).graphs[0].after_ops["opsmath.dropout_add_norm"] == 1
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, _ = opt(x, r)
    masks = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        masks.append(h == 0)
    assert not torch.equal(masks[0], masks[1])
    for m in masks:
        assert abs(m.float().mean().item() - 0.3) < 0.02
