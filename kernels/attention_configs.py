"""Launch configurations of ``opsmath::attention``'s Triton kernels: the candidates the tuner measures
per head dim, the shape bucket a choice is stored under, and the configuration a launch uses (forced
while the tuner measures one, else the bucket's stored choice, else the head dim's default).

A configuration is ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; its cache name ``opsmath:BMxBNwWsS``.
"""
from __future__ import annotations

import math
import re
from typing import Optional

import torch

from .autotune import cached

OWN_ONLY = " own-only"   # key suffix of choices made without the vendor kernels (attention_tuning.choose)


# Block configurations (BLOCK_M, BLOCK_N, num_warps, num_stages) the tuner measures, by padded head dim;
# the first is the default. Pruned by hand to shapes that fit Hopper's shared memory at that head dim.
# D256 from a sweep of 14 (``benchmarks/attention_config_sweep.py``, H200, B4 H8 S2048, causal, softcap 50,
# fwd+bwd): 128x64 w8 s1 1.45 ms, 64x32 w4 s2 1.61, 128x32 w8 s2 1.74, 64x64 w8 s2 2.12, 64x32 w8 s1 (the
# earlier default) 3.20; 128x64 s2, 128x32 s1 and 128x128 s1 do not fit in 227 KiB. The default is the
# second fastest, the smaller tile; the last, the earlier default, stays for GPUs with less shared memory.
CONFIGS = {64: [(64, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)],
           128: [(64, 64, 4, 2), (128, 64, 8, 3), (128, 32, 8, 2), (64, 64, 8, 3)],
           256: [(64, 32, 4, 2), (128, 64, 8, 1), (128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 8, 1)]}
_FORCED: list = [None]   # a configuration the tuner is measuring (``forced_config``)


def configs_for(D: int) -> list[tuple[int, int, int, int]]:
    block_d = max(16, 1 << max(0, math.ceil(math.log2(max(D, 1)))))
    return CONFIGS[min(max(block_d, 64), 256)]


def config_name(cfg) -> str:
    return "opsmath:{}x{}w{}s{}".format(*cfg)


def parse_config(name: Optional[str]) -> Optional[tuple[int, int, int, int]]:
    """``config_name``'s inverse; None for anything else (a vendor choice, no choice)."""
    m = re.fullmatch(r"opsmath:(\d+)x(\d+)w(\d+)s(\d+)", name or "")
    return tuple(int(g) for g in m.groups()) if m else None


class forced_config:
    """``with forced_config((BM, BN, warps, stages)):`` launches use that configuration."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __enter__(self):
        self.prev, _FORCED[0] = _FORCED[0], self.cfg

    def __exit__(self, *exc):
        _FORCED[0] = self.prev


def bucket_key(q, k, has_bias: bool, has_mask: bool, is_causal: bool, dropout_p: float, softcap: float = 0.0,
               window: int = 0) -> str:
    """dtype, exact head dim and head grouping, batch*heads and lengths rounded up to powers of 2, flags."""
    B, H, Sq, D = q.shape
    p2 = (lambda n: 1 << max(0, math.ceil(math.log2(max(n, 1)))))
    return (f"{str(q.dtype).replace('torch.', '')} D={D} H/Hkv={H // k.shape[1]} B*H<={p2(B * H)} "
            f"Sq<={p2(Sq)} Sk<={p2(k.shape[2])} causal={int(is_causal)} bias={int(has_bias)} "
            f"mask={int(has_mask)} dropout={int(dropout_p > 0)}" + (" softcap=1" if softcap else "")
            + (f" window={window}" if window else ""))


def launch_cfg(q: torch.Tensor, D: int, key: Optional[str] = None):
    """(BLOCK_M, BLOCK_N, BLOCK_D, warps, stages): forced by the tuner, else the configuration the tuner
    chose for this shape bucket (``autotune`` cache, op "attention", choice ``opsmath:BMxBNwWsS``),
    else the default for the head dim."""
    block_d = max(16, 1 << max(0, math.ceil(math.log2(max(D, 1)))))
    cfg = _FORCED[0]
    if cfg is None and key is not None:
        for choice in (cached("attention", key), cached("attention", key + OWN_ONLY)):
            cfg = parse_config(choice)
            if cfg is not None:
                break
    if cfg is None and not q.is_cuda:  # interpreter: small blocks keep CPU tests fast
        return 16, 16, block_d, 4, 1
    cfg = cfg or configs_for(D)[0]
    return cfg[0], cfg[1], block_d, cfg[2], cfg[3]


def bucket(q, k, bias, mask, is_causal, dropout_p, softcap=0.0, window=0) -> Optional[str]:
    if not q.is_cuda:
        return None
    return bucket_key(q, k, bias is not None, mask is not None, is_causal, dropout_p, softcap, window)
