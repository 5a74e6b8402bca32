"""Model code written outside this project, as its authors wrote it (small sizes): Meta's LLaMA reference
(complex RoPE, ``repeat_kv``, an additive ``triu`` mask), a lucidrains-style ViT (einops), a DiT block
(adaLN-Zero modulation, ``nn.MultiheadAttention``), a selective-scan SSM (a Python loop over time), a
Switch-style top-1 MoE (``nonzero`` routing), a bidirectional GRU with attention pooling, ``nn.Transformer``
with padding and causal masks, and PaLM's parallel block (SDPA, tied embeddings, z-loss). Each model's
``forward`` returns its loss. ``CASES``: name -> (model class, one batch's inputs from a generator)."""
import math, torch, torch.nn as nn, torch.nn.functional as F

# 1. Meta LLaMA reference: complex RoPE, repeat_kv, SDPA causal
def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)

def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * fc).flatten(3)
    xk_out = torch.view_as_real(xk_ * fc).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__(); self.eps = eps; self.weight = nn.Parameter(torch.ones(dim))
    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight

class MetaAttn(nn.Module):
    def __init__(s, dim, nh, nkv):
        super().__init__(); s.nh, s.nkv, s.hd = nh, nkv, dim // nh
        s.wq = nn.Linear(dim, nh * s.hd, bias=False); s.wk = nn.Linear(dim, nkv * s.hd, bias=False)
        s.wv = nn.Linear(dim, nkv * s.hd, bias=False); s.wo = nn.Linear(nh * s.hd, dim, bias=False)
    def forward(s, x, freqs_cis):
        B, T, _ = x.shape
        xq, xk, xv = s.wq(x).view(B, T, s.nh, s.hd), s.wk(x).view(B, T, s.nkv, s.hd), s.wv(x).view(B, T, s.nkv, s.hd)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        rep = s.nh // s.nkv
        xk = xk[:, :, :, None, :].expand(B, T, s.nkv, rep, s.hd).reshape(B, T, s.nh, s.hd)
        xv = xv[:, :, :, None, :].expand(B, T, s.nkv, rep, s.hd).reshape(B, T, s.nh, s.hd)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(s.hd)
        mask = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        out = torch.matmul(scores, v)
        return s.wo(out.transpose(1, 2).contiguous().view(B, T, -1))

class MetaFF(nn.Module):
    def __init__(s, dim, hid):
        super().__init__(); s.w1 = nn.Linear(dim, hid, bias=False); s.w2 = nn.Linear(hid, dim, bias=False); s.w3 = nn.Linear(dim, hid, bias=False)
    def forward(s, x):
        return s.w2(F.silu(s.w1(x)) * s.w3(x))

class MetaLlama(nn.Module):
    def __init__(s, V=128, dim=64, L=2, nh=4, nkv=2, T=32):
        super().__init__()
        s.tok = nn.Embedding(V, dim)
        s.layers = nn.ModuleList()
        for _ in range(L):
            blk = nn.Module(); blk.attention = MetaAttn(dim, nh, nkv); blk.feed_forward = MetaFF(dim, 4 * dim)
            blk.attention_norm = RMSNorm(dim); blk.ffn_norm = RMSNorm(dim); s.layers.append(blk)
        s.norm = RMSNorm(dim); s.output = nn.Linear(dim, V, bias=False)
        s.freqs_cis = precompute_freqs_cis(dim // nh, T * 2)
    def forward(s, tokens):
        h = s.tok(tokens); T = tokens.shape[1]
        fc = s.freqs_cis.to(h.device)[:T]
        for l in s.layers:
            h = h + l.attention(l.attention_norm(h), fc)
            h = h + l.feed_forward(l.ffn_norm(h))
        logits = s.output(s.norm(h)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

# 2. lucidrains-style ViT with einops
from einops import rearrange, repeat
from einops.layers.torch import Rearrange
class EAttention(nn.Module):
    def __init__(s, dim, heads=4, dim_head=16, dropout=0.):
        super().__init__(); inner = dim_head * heads; s.heads = heads; s.scale = dim_head ** -0.5
        s.norm = nn.LayerNorm(dim); s.attend = nn.Softmax(dim=-1); s.dropout = nn.Dropout(dropout)
        s.to_qkv = nn.Linear(dim, inner * 3, bias=False); s.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(dropout))
    def forward(s, x):
        x = s.norm(x)
        qkv = s.to_qkv(x).chunk(3, dim=-1)
        q, k, v = map(lambda t: rearrange(t, 'b n (h d) -> b h n d', h=s.heads), qkv)
        dots = torch.matmul(q, k.transpose(-1, -2)) * s.scale
        attn = s.dropout(s.attend(dots))
        out = torch.matmul(attn, v)
        return s.to_out(rearrange(out, 'b h n d -> b n (h d)'))
class EViT(nn.Module):
    def __init__(s, image=32, patch=8, classes=10, dim=64, depth=2, heads=4, mlp=128):
        super().__init__(); n = (image // patch) ** 2; pd = 3 * patch * patch
        s.to_patch = nn.Sequential(Rearrange('b c (h p1) (w p2) -> b (h w) (p1 p2 c)', p1=patch, p2=patch), nn.LayerNorm(pd), nn.Linear(pd, dim), nn.LayerNorm(dim))
        s.pos = nn.Parameter(torch.randn(1, n + 1, dim)); s.cls = nn.Parameter(torch.randn(1, 1, dim))
        s.layers = nn.ModuleList([nn.ModuleList([EAttention(dim, heads), nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))]) for _ in range(depth)])
        s.norm = nn.LayerNorm(dim); s.head = nn.Linear(dim, classes)
    def forward(s, img, labels):
        x = s.to_patch(img); b, n, _ = x.shape
        cls = repeat(s.cls, '1 1 d -> b 1 d', b=b)
        x = torch.cat((cls, x), dim=1) + s.pos[:, :(n + 1)]
        for attn, ff in s.layers:
            x = attn(x) + x; x = ff(x) + x
        return F.cross_entropy(s.head(s.norm(x)[:, 0]), labels, label_smoothing=0.1)

# 3. DiT block with adaLN-Zero modulation
def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
class DiTBlock(nn.Module):
    def __init__(s, hidden, heads, mlp_ratio=4.0):
        super().__init__()
        s.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        s.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        s.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        s.mlp = nn.Sequential(nn.Linear(hidden, int(hidden * mlp_ratio)), nn.GELU(approximate="tanh"), nn.Linear(int(hidden * mlp_ratio), hidden))
        s.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden, bias=True))
    def forward(s, x, c):
        sm, scm, gm, smlp, scmlp, gmlp = s.adaLN(c).chunk(6, dim=1)
        h = modulate(s.norm1(x), sm, scm)
        x = x + gm.unsqueeze(1) * s.attn(h, h, h, need_weights=False)[0]
        x = x + gmlp.unsqueeze(1) * s.mlp(modulate(s.norm2(x), smlp, scmlp))
        return x
class DiT(nn.Module):
    def __init__(s, hidden=64, heads=4, depth=2, C=4, patch=2, size=8):
        super().__init__()
        s.x_emb = nn.Conv2d(C, hidden, patch, patch); s.t_emb = nn.Sequential(nn.Linear(32, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        s.blocks = nn.ModuleList([DiTBlock(hidden, heads) for _ in range(depth)])
        s.final = nn.Linear(hidden, patch * patch * C); s.patch, s.C = patch, C
    def t_freq(s, t, dim=32):
        half = dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    def forward(s, x, t, noise):
        h = s.x_emb(x).flatten(2).transpose(1, 2)
        c = s.t_emb(s.t_freq(t))
        for b in s.blocks:
            h = b(h, c)
        out = s.final(h)
        return F.mse_loss(out, noise)

# 4. Mamba-ish: causal depthwise conv + gated sequential scan
class SSM(nn.Module):
    def __init__(s, d=32, n=8, T=16):
        super().__init__(); s.inp = nn.Linear(d, 2 * d); s.conv = nn.Conv1d(d, d, 4, groups=d, padding=3)
        s.A_log = nn.Parameter(torch.log(torch.rand(d, n) + 0.5)); s.B = nn.Linear(d, n); s.Cp = nn.Linear(d, n); s.dt = nn.Linear(d, d); s.out = nn.Linear(d, d)
    def forward(s, x, y):
        T = x.shape[1]
        u, z = s.inp(x).chunk(2, -1)
        u = F.silu(s.conv(u.transpose(1, 2))[..., :T].transpose(1, 2))
        dt = F.softplus(s.dt(u)); A = -torch.exp(s.A_log)
        B, C = s.B(u), s.Cp(u)
        h = x.new_zeros(x.shape[0], x.shape[2], A.shape[1]); ys = []
        for t in range(T):
            h = torch.exp(dt[:, t, :, None] * A) * h + dt[:, t, :, None] * B[:, t, None, :] * u[:, t, :, None]
            ys.append((h * C[:, t, None, :]).sum(-1))
        o = s.out(torch.stack(ys, 1) * F.silu(z))
        return F.mse_loss(o, y)

# 5. Switch-style top-1 MoE with capacity drop
class Switch(nn.Module):
    def __init__(s, d=32, E=4, cap=1.25):
        super().__init__(); s.router = nn.Linear(d, E, bias=False); s.E = E; s.cap = cap
        s.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d)) for _ in range(E)])
        s.head = nn.Linear(d, 5)
    def forward(s, x, labels):
        B, T, d = x.shape; xs = x.reshape(-1, d)
        probs = s.router(xs).softmax(-1); gate, idx = probs.max(-1)
        out = torch.zeros_like(xs)
        for e in range(s.E):
            sel = (idx == e).nonzero(as_tuple=True)[0]
            out[sel] = s.experts[e](xs[sel]) * gate[sel, None]
        aux = (probs.mean(0) * F.one_hot(idx, s.E).float().mean(0)).sum() * s.E
        return F.cross_entropy(s.head(out + xs), labels.reshape(-1)) + 0.01 * aux

# 6. GRU encoder + attention pooling
class RNNPool(nn.Module):
    def __init__(s, d=16):
        super().__init__(); s.rnn = nn.GRU(d, d, batch_first=True, bidirectional=True); s.q = nn.Parameter(torch.randn(2 * d)); s.o = nn.Linear(2 * d, 3)
    def forward(s, x, labels):
        h, _ = s.rnn(x)
        w = torch.softmax(h @ s.q, dim=1)
        return F.cross_entropy(s.o((w.unsqueeze(-1) * h).sum(1)), labels)

# 7. nn.Transformer seq2seq with masks
class Seq2Seq(nn.Module):
    def __init__(s, V=64, d=32):
        super().__init__(); s.emb = nn.Embedding(V, d); s.tf = nn.Transformer(d, 4, 2, 2, 64, dropout=0.0, batch_first=True); s.out = nn.Linear(d, V)
    def forward(s, src, tgt, src_pad):
        T = tgt.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(T, device=src.device)
        h = s.tf(s.emb(src), s.emb(tgt[:, :-1]), tgt_mask=causal[:-1, :-1], src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad)
        return F.cross_entropy(s.out(h).reshape(-1, s.out.out_features), tgt[:, 1:].reshape(-1))

# 8. PaLM-style: parallel block, shared input norm, z-loss, tied embeddings, SDPA with is_causal
class PaLMBlock(nn.Module):
    def __init__(s, d=64, h=4):
        super().__init__(); s.norm = nn.LayerNorm(d, bias=False); s.h = h
        s.fused = nn.Linear(d, 3 * d + 2 * 2 * d, bias=False); s.attn_out = nn.Linear(d, d, bias=False); s.ff_out = nn.Linear(2 * d, d, bias=False)
    def forward(s, x):
        B, T, d = x.shape; n = s.norm(x)
        q, k, v, ff, gate = s.fused(n).split([d, d, d, 2 * d, 2 * d], -1)
        q, k, v = (t.view(B, T, s.h, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        return x + s.attn_out(a) + s.ff_out(F.silu(gate) * ff)
class PaLM(nn.Module):
    def __init__(s, V=128, d=64, L=2):
        super().__init__(); s.emb = nn.Embedding(V, d); s.blocks = nn.Sequential(*[PaLMBlock(d) for _ in range(L)]); s.norm = nn.LayerNorm(d)
    def forward(s, tok):
        h = s.norm(s.blocks(s.emb(tok)))
        logits = h @ s.emb.weight.t()
        lse = torch.logsumexp(logits.float(), -1)
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tok[:, 1:].reshape(-1))
        return ce + 1e-4 * (lse ** 2).mean()

def _randn(g, *s):
    return torch.randn(*s, generator=g)


def _ints(g, hi, *s):
    return torch.randint(0, hi, s, generator=g)


def _padding():
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, 9:] = True
    return pad


CASES = {
    "meta_llama": (MetaLlama, lambda g: (_ints(g, 128, 2, 32),)),
    "einops_vit": (EViT, lambda g: (_randn(g, 2, 3, 32, 32), _ints(g, 10, 2))),
    "dit": (DiT, lambda g: (_randn(g, 2, 4, 8, 8), _ints(g, 1000, 2), _randn(g, 2, 16, 16))),
    "ssm_scan": (SSM, lambda g: (_randn(g, 2, 16, 32), _randn(g, 2, 16, 32))),
    "switch_moe": (Switch, lambda g: (_randn(g, 2, 8, 32), _ints(g, 5, 2, 8))),
    "gru_pool": (RNNPool, lambda g: (_randn(g, 3, 7, 16), _ints(g, 3, 3))),
    "nn_transformer": (Seq2Seq, lambda g: (_ints(g, 64, 2, 12), _ints(g, 64, 2, 9), _padding())),
    "palm": (PaLM, lambda g: (_ints(g, 128, 2, 24),)),
}
