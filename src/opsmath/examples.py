"""Bundled example models, written the way research code writes them (nothing opsmath-specific).

``gpt``: a nanoGPT-style decoder (hand-written causal attention with a ``tril`` buffer, pre-LN,
dropout on attention probabilities and residual branches). ``llama``: a LLaMA-style decoder written by
hand (RMSNorm as ``x * rsqrt(mean(x^2) + eps) * w``, RoPE, GQA through ``repeat_kv``, SwiGLU).
``dit``: a diffusion transformer as the DiT repository writes it (timm-style attention by hand, adaLN
modulation of affine-free LayerNorms, gated residuals, tanh-GELU MLP) with the noise-prediction loss.
``moe``: the LLaMA decoder with a Mixtral-style sparse MLP as the Mistral reference code writes it (a
linear router, top-k, softmax over the chosen logits, a Python loop over ``nn.ModuleList`` experts with
``torch.where``) plus the Switch Transformer auxiliary load-balancing loss.
Each factory returns ``(model, example_batch)`` where ``model(*batch)`` returns the loss.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd, dropout):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """nanoGPT's model, trimmed: ``GPT(...)(idx, targets) -> loss``."""

    def __init__(self, vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class LlamaAttention(nn.Module):
    def __init__(self, dim, n_head, n_kv_head, max_len):
        super().__init__()
        self.n_head, self.n_kv_head, self.hd = n_head, n_kv_head, dim // n_head
        self.q_proj = nn.Linear(dim, n_head * self.hd, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_head * self.hd, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_head * self.hd, bias=False)
        self.o_proj = nn.Linear(n_head * self.hd, dim, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        freqs = torch.outer(torch.arange(max_len).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x, mask):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
        cos, sin = self.cos[:T], self.sin[:T]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = _repeat_kv(k, self.n_head // self.n_kv_head)
        v = _repeat_kv(v, self.n_head // self.n_kv_head)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
        scores = scores + mask
        probs = F.softmax(scores.float(), dim=-1).type_as(q)
        out = torch.matmul(probs, v)
        return self.o_proj(out.transpose(1, 2).contiguous().view(B, T, -1))


class LlamaBlock(nn.Module):
    def __init__(self, dim, n_head, n_kv_head, hidden, max_len):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = LlamaAttention(dim, n_head, n_kv_head, max_len)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x, mask):
        h = x + self.attention(self.attention_norm(x), mask)
        n = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))


class Llama(nn.Module):
    """A hand-written LLaMA: ``Llama(...)(tokens, targets) -> loss``; additive float causal mask."""

    def __init__(self, vocab_size=256, dim=64, n_layer=2, n_head=4, n_kv_head=2, hidden=128, max_len=64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([LlamaBlock(dim, n_head, n_kv_head, hidden, max_len) for _ in range(n_layer)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens, targets):
        B, T = tokens.shape
        h = self.tok_embeddings(tokens)
        mask = torch.full((T, T), float("-inf"), device=tokens.device).triu(1)
        for layer in self.layers:
            h = layer(h, mask)
        logits = self.output(self.norm(h)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class Expert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Top-k routing over ``n_expert`` SwiGLU experts; ``aux`` holds the last call's load-balancing loss
    ``n_expert * sum_e(fraction of routed slots to e * mean router probability of e)``."""

    def __init__(self, dim, hidden, n_expert=4, top_k=2):
        super().__init__()
        self.gate = nn.Linear(dim, n_expert, bias=False)
        self.experts = nn.ModuleList([Expert(dim, hidden) for _ in range(n_expert)])
        self.top_k = top_k

    def forward(self, x):
        shape = x.shape
        x = x.view(-1, shape[-1])
        logits = self.gate(x)
        weights, selected = torch.topk(logits, self.top_k)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(x.dtype)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            batch_idx, nth = torch.where(selected == i)
            out[batch_idx] += weights[batch_idx, nth, None] * expert(x[batch_idx])
        routed = F.one_hot(selected, len(self.experts)).float().sum(1).mean(0) / self.top_k
        self.aux = len(self.experts) * (routed * F.softmax(logits.float(), -1).mean(0)).sum()
        return out.view(shape)


class MoEBlock(LlamaBlock):
    def __init__(self, dim, n_head, n_kv_head, hidden, max_len, n_expert, top_k):
        super().__init__(dim, n_head, n_kv_head, hidden, max_len)
        del self.w1, self.w2, self.w3
        self.moe = SparseMoE(dim, hidden, n_expert, top_k)

    def forward(self, x, mask):
        h = x + self.attention(self.attention_norm(x), mask)
        return h + self.moe(self.ffn_norm(h))


class Mixtral(Llama):
    """``Llama`` with a sparse MoE MLP in every block; the loss adds ``aux_weight`` times the blocks'
    load-balancing losses."""

    def __init__(self, n_expert=4, top_k=2, aux_weight=0.01, **kw):
        super().__init__(**kw)
        dim, n_head = self.tok_embeddings.embedding_dim, self.layers[0].attention.n_head
        n_kv, hidden = self.layers[0].attention.n_kv_head, self.layers[0].w1.out_features
        max_len = self.layers[0].attention.cos.shape[0]
        self.layers = nn.ModuleList([MoEBlock(dim, n_head, n_kv, hidden, max_len, n_expert, top_k)
                                     for _ in self.layers])
        self.aux_weight = aux_weight

    def forward(self, tokens, targets):
        loss = super().forward(tokens, targets)
        return loss + self.aux_weight * sum(layer.moe.aux for layer in self.layers)


def _modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTAttention(nn.Module):
    """timm's ``Attention`` on its non-fused path: one qkv projection, q pre-scaled, softmax by hand."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = DiTAttention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"), nn.Linear(4 * hidden, hidden))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(_modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(_modulate(self.norm2(x), shift_mlp, scale_mlp))


class DiT(nn.Module):
    """Class-conditional DiT on latents (C, H, W); ``forward(x0, t, y, noise)`` is the training loss:
    noise the latents at timesteps ``t`` (cosine schedule) and regress the noise (MSE)."""

    def __init__(self, img=16, patch=4, channels=4, hidden=64, depth=2, heads=4, classes=10):
        super().__init__()
        self.patch = patch
        self.x_embed = nn.Conv2d(channels, hidden, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, (img // patch) ** 2, hidden))
        self.t_embed = nn.Sequential(nn.Linear(256, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.y_embed = nn.Embedding(classes + 1, hidden)
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads) for _ in range(depth))
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final_mod = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.final = nn.Linear(hidden, patch * patch * channels)

    def denoise(self, x, t, y):
        B, C, H, W = x.shape
        half = 128
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=x.device) / half)
        args = t[:, None].float() * freqs[None]
        t_freq = torch.cat([torch.cos(args), torch.sin(args)], -1).to(x.dtype)   # fp32 math, model's dtype out
        c = self.t_embed(t_freq) + self.y_embed(y)
        h = self.x_embed(x).flatten(2).transpose(1, 2) + self.pos
        for blk in self.blocks:
            h = blk(h, c)
        shift, scale = self.final_mod(c).chunk(2, dim=1)
        h = self.final(_modulate(self.norm_final(h), shift, scale))
        p = self.patch
        return h.reshape(B, H // p, W // p, p, p, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, H, W)

    def forward(self, x0, t, y, noise):
        a = torch.cos(t.float() / 1000 * math.pi / 2)[:, None, None, None].to(x0.dtype)
        return F.mse_loss(self.denoise(a * x0 + (1 - a * a).sqrt() * noise, t, y), noise)


def gpt(batch_size=4, seq_len=64, **kw):
    """A small nanoGPT and one batch of random tokens."""
    model = GPT(block_size=max(seq_len, 64), **kw)
    idx = torch.randint(0, model.wte.num_embeddings, (batch_size, seq_len))
    return model, (idx, torch.roll(idx, -1, dims=1))


def llama(batch_size=4, seq_len=64, **kw):
    """A small hand-written LLaMA (GQA 4/2, RoPE, RMSNorm, SwiGLU) and one batch of random tokens."""
    model = Llama(max_len=max(seq_len, 64), **kw)
    tok = torch.randint(0, model.tok_embeddings.num_embeddings, (batch_size, seq_len))
    return model, (tok, torch.roll(tok, -1, dims=1))


def moe(batch_size=4, seq_len=64, **kw):
    """A small Mixtral-style decoder (4 experts, top-2, hand-written routing loop) and one batch."""
    model = Mixtral(max_len=max(seq_len, 64), **kw)
    tok = torch.randint(0, model.tok_embeddings.num_embeddings, (batch_size, seq_len))
    return model, (tok, torch.roll(tok, -1, dims=1))


def dit(batch_size=4, img=16, **kw):
    """A small class-conditional DiT and one batch: latents, timesteps, labels, noise."""
    model = DiT(img=img, **kw)
    return model, (torch.randn(batch_size, 4, img, img), torch.randint(0, 1000, (batch_size,)),
                   torch.randint(0, 10, (batch_size,)), torch.randn(batch_size, 4, img, img))


EXAMPLES = {"gpt": gpt, "llama": llama, "dit": dit, "moe": moe}
