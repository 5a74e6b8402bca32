"""Launch configurations of ``opsmath::attention``'s Triton kernels: the candidates the tuner measures
per head dim, the shape bucket a choice is stored under, and the configuration a launch uses (forced
while the tuner measures one, else the bucket's stored choice, else the head dim's default).

A configuration is ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; its cache name ``opsmath:BMxBNwWsS``.
The three kernels (forward, dQ, dK/dV: ``KERNELS``) are separate launches, so each may run its own
configuration: the tuner stores, beside its choice, the fastest configuration of each kernel as it
measured them (op ``"attention_tiles"``, name ``tiles_name``), and a launch reads its kernel's. On the
H200 at D256 with a softcap the three best differ (``benchmarks/results/attention_config_sweep-d256-*``):
forward 64x32 w4 s2, dQ 64x32 w4 s1 / 64x64 w4 s2, dK/dV 128x64 w8 s1, 7.7% (B1 H16 S8192) and 8.1% (B4 H8
S2048) less kernel time than the best single configuration.
"""
from __future__ import annotations

import functools
import math
import re
import threading
from types import MappingProxyType
from typing import Optional

import torch

from opsmath.kernels.autotune import cached

OWN_ONLY = " own-only"   # key suffix of choices made without the vendor kernels (tuning.choose)
KERNELS = {"fwd": "_attn_fwd", "dq": "_attn_bwd_dq", "dkdv": "_attn_bwd_dkdv"}   # launch: Triton kernel name
TILES = "attention_tiles"   # the autotune op under which each bucket's per-kernel configurations are stored


# Block configurations (BLOCK_M, BLOCK_N, num_warps, num_stages) the tuner measures, by padded head dim;
# the first is the default. Pruned by hand to shapes that fit Hopper's shared memory at that head dim.
# D256 from sweeps of 20 (``benchmarks/results/attention_config_sweep-d256-*``, H200, causal, softcap 50,
# each kernel's GPU time): at B1 H16 S8192 the forward runs fastest in 64x32 w4 s2 (2.01 ms; 128x64 w8 s1 2.48), dQ in
# 64x32 w4 s1 (2.50) and 64x64 w4 s2 (2.66; the fastest at B4 H8 S2048), dK/dV in 128x64 w8 s1 (3.60; 64x32
# w4 s2 4.77); 128x32 w8 s2 stays (the third fwd+bwd at B4 H8 S2048, 1.74 ms); 128x64 s2, 128x32 s1 and
# 128x128 s1 do not fit in 227 KiB. The default is fast in every kernel, 64x32 w4 s2; 64x32 w4 s1 also
# fits GPUs with less shared memory.
# D128: 128x64 w8 s3 needs 248832 bytes of shared memory, over the H200's 232448: it failed both times it was
# tuned (Gemma-2's window layers, after 4.8-5.4 s of compile: ``results/tuning-cache-gemma2-bf16-20261204.json``).
CONFIGS = {64: [(64, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)],
           128: [(64, 64, 4, 2), (128, 32, 8, 2), (64, 64, 8, 3)],
           256: [(64, 32, 4, 2), (128, 64, 8, 1), (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 1)]}
_FORCED: list = [None]   # a configuration the tuner is measuring (``forced_config``)
_AHEAD = threading.local()   # one compiling thread's configuration (``tuning.compile_ahead``), over _FORCED


def configs_for(D: int) -> list[tuple[int, int, int, int]]:
    block_d = max(16, 1 << max(0, math.ceil(math.log2(max(D, 1)))))
    return CONFIGS[min(max(block_d, 64), 256)]


def config_name(cfg) -> str:
    return "opsmath:{}x{}w{}s{}".format(*cfg)


@functools.lru_cache(maxsize=256)   # read at every launch (``launch_cfg``)
def parse_config(name: Optional[str]) -> Optional[tuple[int, int, int, int]]:
    """``config_name``'s inverse; None for anything else (a vendor choice, no choice)."""
    m = re.fullmatch(r"opsmath:(\d+)x(\d+)w(\d+)s(\d+)", name or "")
    return tuple(int(g) for g in m.groups()) if m else None


def tiles_name(tiles: dict) -> str:
    """``{"fwd": cfg, "dq": cfg, "dkdv": cfg}`` as stored: ``opsmath:fwd=BMxBNwWsS,dq=...,dkdv=...``."""
    return "opsmath:" + ",".join(f"{k}=" + config_name(tiles[k])[len("opsmath:"):] for k in KERNELS)


@functools.lru_cache(maxsize=256)   # read at every launch (``launch_cfg``)
def parse_tiles(name: Optional[str]) -> Optional[MappingProxyType]:
    """``tiles_name``'s inverse (read-only: it is shared between launches); None for anything else."""
    if not (name or "").startswith("opsmath:"):
        return None
    parts = dict(p.split("=", 1) for p in name[len("opsmath:"):].split(",") if "=" in p)
    tiles = {k: parse_config("opsmath:" + parts.get(k, "")) for k in KERNELS}
    return MappingProxyType(tiles) if all(tiles.values()) else None


def _kernel_ms(times: dict, kernel: str) -> float:
    """Milliseconds of launch ``kernel`` (``KERNELS``) in profiled ``{kernel name: ms per call}``."""
    return sum(t for name, t in times.items() if KERNELS[kernel] in name)


def fastest_tiles(per_config: dict) -> Optional[dict]:
    """From ``{cfg: {kernel name: ms per call}}`` (each configuration's profiled kernels), each launch's
    fastest configuration among those that ran all three kernels; None when none did."""
    full = {c: t for c, t in per_config.items() if all(any(n in name for name in t) for n in KERNELS.values())}
    if not full:
        return None
    return {k: min(full, key=lambda c: _kernel_ms(full[c], k)) for k in KERNELS}


def tiles_entry(per_config: dict) -> Optional[dict]:
    """The tuning cache entry for ``fastest_tiles(per_config)``: the choice and each configuration's
    milliseconds per kernel; None when no configuration ran all three kernels."""
    tiles = fastest_tiles(per_config)
    if tiles is None:
        return None
    ms = {config_name(c): {k: round(_kernel_ms(times, k), 5) for k in KERNELS} for c, times in per_config.items()}
    return dict(choice=tiles_name(tiles), ms=ms)


class forced_config:
    """``with forced_config((BM, BN, warps, stages)):`` launches use that configuration; a dict
    ``{"fwd": cfg, "dq": cfg, "dkdv": cfg}`` gives each kernel its own."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __enter__(self):
        self.prev, _FORCED[0] = _FORCED[0], self.cfg

    def __exit__(self, *exc):
        _FORCED[0] = self.prev


def size_hint(n) -> int:
    """A size as an int. A symbolic size (the op traced into a graph whose lengths change, as a
    ``triton_op`` is under Inductor) counts as its example value, so that choosing tiles adds no guard on
    it (a guard would make the graph recompile for every length); an unbacked one as ``UNBACKED``."""
    if isinstance(n, torch.SymInt):
        hint = n.node.hint
        return int(hint) if hint is not None else UNBACKED
    return int(n)


UNBACKED = 4096   # the length a size known only at run time is tuned for


def bucket_key(q, k, has_bias: bool, has_mask: bool, is_causal: bool, dropout_p: float, softcap: float = 0.0,
               window: int = 0) -> str:
    """dtype, exact head dim and head grouping, batch*heads and lengths rounded up to powers of 2, flags."""
    B, H, Sq, D = (size_hint(n) for n in q.shape)
    Hkv, Sk = size_hint(k.shape[1]), size_hint(k.shape[2])
    p2 = (lambda n: 1 << max(0, math.ceil(math.log2(max(n, 1)))))
    return (f"{str(q.dtype).replace('torch.', '')} D={D} H/Hkv={H // Hkv} B*H<={p2(B * H)} "
            f"Sq<={p2(Sq)} Sk<={p2(Sk)} causal={int(is_causal)} bias={int(has_bias)} "
            f"mask={int(has_mask)} dropout={int(dropout_p > 0)}" + (" softcap=1" if softcap else "")
            + (f" window={window}" if window else ""))


def launch_cfg(q: torch.Tensor, D: int, key: Optional[str] = None, kernel: str = "fwd"):
    """(BLOCK_M, BLOCK_N, BLOCK_D, warps, stages) of ``kernel`` (``KERNELS``): forced by the tuner, else
    the tuner's per-kernel configuration for this shape bucket (op ``TILES``), else its choice
    (``autotune`` cache, op "attention", choice ``opsmath:BMxBNwWsS``), else the head dim's default."""
    block_d = max(16, 1 << max(0, math.ceil(math.log2(max(D, 1)))))
    cfg = getattr(_AHEAD, "cfg", None) or _FORCED[0]
    if isinstance(cfg, dict):
        cfg = cfg[kernel]
    if cfg is None and key is not None:
        for k in (key, key + OWN_ONLY):
            choice = cached("attention", k)
            tiles = parse_tiles(cached(TILES, k)) if parse_config(choice) or choice == "opsmath" else None
            cfg = tiles[kernel] if tiles else parse_config(choice)
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


def bias_mask_args(q, k, bias, mask):
    """bias/mask as (B, H, Sq, Sk) stride-0 views (dummies when absent), and HAS_BIAS: 0 none, 2 per-key, 1 other."""
    B, H, Sq, _ = q.shape
    full = (B, H, Sq, k.shape[2])
    b = bias.expand(full) if bias is not None else q.new_empty(1)
    # a bool mask as bytes before it is expanded: a copy of the mask's own size (Inductor in torch 2.11 fails
    # to lower a bool -> uint8 bitcast view: "torch.bool is not supported by torch.iinfo")
    m = mask.to(torch.uint8).expand(full) if mask is not None else q.new_empty(1, dtype=torch.uint8)
    bs = b.stride() if bias is not None else (0, 0, 0, 0)
    ms = m.stride() if mask is not None else (0, 0, 0, 0)
    return b, m, bs, ms, 0 if bias is None else 2 if bs[2] == 0 and Sq > 1 else 1
