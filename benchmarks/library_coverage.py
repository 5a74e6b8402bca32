"""Held-out models from two more third-party libraries (CPU, fp32, training mode, tiny sizes), beside the
transformers, timm and diffusers harnesses (``hf_coverage``, ``timm_coverage``, ``diffusers_coverage``):

- ``x-transformers`` (lucidrains): decoders and an encoder with its option spellings: RMSNorm through
  ``F.normalize``, rotary embeddings, grouped KV heads, GLU feed-forwards, the ``attn_flash`` (SDPA) flag;
- ``fair-esm``: ESM-2, fairseq's attention (``bmm`` scores, ``softmax(dtype=float32).type_as(scores)``),
  its rotary embedding and masked-LM head.

Per configuration: the rewrites, every decline with its reason (``not recognized (...)`` marks a candidate
no rule reads: the no-silent-skips contract), the loss against eager and the worst parameter-gradient
error (``hf_coverage.worst_grad_error``). ``tests/test_library_coverage.py`` holds the same cases to
these expectations. Needs ``pip install x-transformers fair-esm`` (both in the dev extras).

    python -m benchmarks library_coverage [name ...]
"""
from __future__ import annotations

import copy
import sys
from collections import Counter

import torch
import torch.nn.functional as F

import opsmath
from benchmarks.hf_coverage import worst_grad_error

VOCAB, T = 64, 24


def _xt_decoder(**kw):
    from x_transformers import Decoder, TransformerWrapper
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=T, attn_layers=Decoder(dim=64, depth=2, heads=4, **kw))


def _xt_encoder(**kw):
    from x_transformers import Encoder, TransformerWrapper
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=T, attn_layers=Encoder(dim=64, depth=2, heads=4, **kw))


def _esm2():
    import esm
    return esm.ESM2(num_layers=2, embed_dim=64, attention_heads=4, alphabet="ESM-1b", token_dropout=False)


def _lm_loss(model, ids):    # next-token loss of a TransformerWrapper (logits out)
    return F.cross_entropy(model(ids[:, :-1]).transpose(1, 2), ids[:, 1:])


def _mlm_loss(model, ids):   # an encoder's token loss
    return F.cross_entropy(model(ids).transpose(1, 2), ids)


def _esm_loss(model, ids):   # ESM-2 returns a dict; tokens 4..23 are amino acids (no padding)
    return F.cross_entropy(model(ids + 4)["logits"].transpose(1, 2), ids + 4)


# name: (library, builder, loss, token range); the expectations are the test's
CASES = {
    "xt_decoder": ("x-transformers", lambda: _xt_decoder(), _lm_loss, VOCAB),
    "xt_decoder_flash": ("x-transformers", lambda: _xt_decoder(attn_flash=True), _lm_loss, VOCAB),
    "xt_llama_like": ("x-transformers", lambda: _xt_decoder(rotary_pos_emb=True, ff_swish=True, ff_glu=True,
                                                            use_rmsnorm=True, attn_kv_heads=2), _lm_loss, VOCAB),
    "xt_simple_rmsnorm_geglu": ("x-transformers", lambda: _xt_decoder(use_simple_rmsnorm=True, ff_glu=True,
                                                                      rotary_pos_emb=True), _lm_loss, VOCAB),
    "xt_encoder": ("x-transformers", lambda: _xt_encoder(), _mlm_loss, VOCAB),
    "esm2": ("fair-esm", _esm2, _esm_loss, 20),
}


def check(name: str) -> dict:
    """Train one step of ``name`` under opsmath and eagerly from one seed: its coverage row."""
    library, build, loss_fn, vocab = CASES[name]
    torch.manual_seed(0)
    model = build().train()
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    opt = opsmath.optimize(model)
    ids = torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (opt, eager):
        torch.manual_seed(2)   # the same dropout draws on both sides, where a configuration has any
        loss = loss_fn(m, ids)
        loss.backward()
        losses.append(loss.item())
    rep = opsmath.report(opt)
    return dict(name=name, library=library, rewrites=dict(Counter(m.pattern for m in rep.matches)),
                declines=[(d.pattern, d.reason) for d in rep.declines], fallbacks=list(rep.fallback_errors),
                loss=losses[0], eager_loss=losses[1], grad_err=worst_grad_error(opt, eager))


def line(r: dict) -> str:
    declines = "; ".join(f"{p}: {why}" for p, why in dict.fromkeys(r["declines"])) or "none"
    return (f"{r['name']:26} {r['library']:15} loss {r['loss']:.6f} / {r['eager_loss']:.6f}  dgrad {r['grad_err']:.1e}  "
            f"rewrites {r['rewrites']}  declines: {declines}  fallbacks {len(r['fallbacks'])}")


def main():
    for name in sys.argv[1:] or CASES:
        try:
            print(line(check(name)), flush=True)
        except Exception as e:  # noqa: BLE001  (reported; the other cases still run)
            print(f"{name:26} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
