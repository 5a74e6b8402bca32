"""Attention tuning: the rewrite's per-shape choice among opsmath's kernel (in each of a few block
configurations) and PyTorch's SDPA backends, and the block configuration opsmath's kernel launches with.

``opsmath::attention`` (``attention.py``) computes::

    O = dropout(softmax(where(mask, fill, scale * Q K^T + bias) [causal: -inf above the diagonal])) V

SDPA's flash, cuDNN and memory-efficient backends compute the same function when it is expressed in
their terms: the boolean mask folds into an additive ``-inf`` bias (only for ``fill = -inf``: a finite
fill such as ``finfo.min`` makes fully masked rows uniform, which an additive bias in bf16 cannot
promise), causal goes to ``is_causal`` when there is no bias (else into the bias, top-left aligned,
as ours), GQA to ``enable_gqa``. Their dropout draws its own (Philox) bits: the same distribution
as ours and as eager's, not the same mask.

``choose(...)`` measures forward+backward of every candidate on random tensors of the real shapes:
opsmath's kernel in each configuration of ``CONFIGS`` for the head dim, and each SDPA backend that takes
the inputs and passes ``accurate_backends`` (docs/design.md's rule against an fp32 reference, output and
gradients). The winner is stored by ``src/opsmath/kernels/autotune.py`` (per GPU, versions, dtype and shape
bucket; persisted) and returned as ``"opsmath"`` or ``"sdpa_flash"`` / ``"sdpa_cudnn"`` /
``"sdpa_efficient"``; when opsmath's kernel wins in a configuration ``opsmath:BMxBNwWsS``, its launches
read that configuration back from the cache (``configs.launch_cfg``), and where its three
kernels measured fastest in different configurations, each kernel's own (op ``attention_tiles``).
``sdpa(...)`` is what the emitted graph calls for a vendor choice.
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from opsmath.kernels._common import dropout_keep, flat_offsets
from opsmath.kernels._spec import OpSpec, register
from opsmath.kernels.attention import attention_flops, attention_op, attention_reference, exercise
from opsmath.kernels.attention.kernel import attention_backward_triton, attention_forward_triton
from opsmath.kernels.attention.configs import (_AHEAD, KERNELS, OWN_ONLY, TILES, bucket_key, config_name,
                                               configs_for, forced_config, tiles_entry)
from opsmath.kernels.autotune import SPENT, AllCandidatesFailed, cached, measure, pick, store

BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
         is_causal: bool, scale: float, dropout_p: float, backend: str) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` restricted to one backend; ``bias`` is additive (B, H, Sq, Sk)
    broadcastable, ``-inf`` where masked. Q: (B, H, Sq, D), K/V: (B, Hkv, Sk, D) -> O: (B, H, Sq, D)."""
    if bias is not None:
        # a finite fill (fp32's finfo.min, HF's) would round to -inf in bf16: clamped, its fully masked rows
        # stay uniform, as eager's; -inf (a mask, causal, a window) stays -inf, so a row with no visible key
        # is 0, as opsmath's kernel and SDPA's math path (cuDNN with a boolean mask is not: measured,
        # results/sdpa_dead_rows-20261201.json; with a -inf bias every backend gives 0)
        bias = torch.where(torch.isneginf(bias), bias, bias.clamp(min=torch.finfo(q.dtype).min)).to(q.dtype)
    with sdpa_kernel([BACKENDS[backend]]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])


def vendor_eligible(device: torch.device, mask_fill: float, bias_requires_grad: bool) -> bool:
    """Whether SDPA backends may stand in: CUDA, masks that fold into a -inf bias, no bias gradient
    (not every backend returns one)."""
    return device.type == "cuda" and not bias_requires_grad and mask_fill == float("-inf")


def backend_for(q: torch.Tensor, k: torch.Tensor, bias_shape, mask_shape, mask_fill: float, is_causal: bool,
                scale: float, dropout_p: float, bias_requires_grad: bool, softcap: float = 0.0, window: int = 0) -> str:
    """What the attention rewrite emits for ``q``/``k`` (capture-time fake tensors: shapes, dtype, device):
    ``"opsmath"`` or the SDPA backend measured fastest (CUDA only). ``OPSMATH_ATTENTION=opsmath`` (or a
    backend name, where vendors may stand in) forces one. A tuning failure falls back to opsmath's own
    kernel, which is always valid: tuning never breaks a capture. Where every candidate failed to run on
    this GPU (opsmath's kernel in every block configuration, e.g. for want of shared memory, and every SDPA
    backend allowed), ``"math"``: the attention as user code computes it (``eager_same_dtype``), which
    runs anywhere. No SDPA backend takes a softcap."""
    forced = os.environ.get("OPSMATH_ATTENTION", "auto")
    if forced == "opsmath" or q.device.type != "cuda":
        return "opsmath"
    vendors_ok = vendor_eligible(q.device, mask_fill, bias_requires_grad) and not softcap
    if forced in BACKENDS and vendors_ok:
        return forced
    try:   # opsmath's block configurations are tuned even where no vendor kernel may stand in
        return choose(tuple(q.shape), tuple(k.shape), q.dtype, q.device, bias_shape, mask_shape, mask_fill,
                      is_causal, scale, dropout_p, vendors=vendors_ok, softcap=softcap, window=window)
    except AllCandidatesFailed as e:
        logging.getLogger("opsmath").warning("opsmath: no attention kernel ran for these shapes on this GPU (%s); "
                                             "computing it as written", e)
        return "math"
    except Exception as e:
        logging.getLogger("opsmath").warning("opsmath: attention backend tuning failed (%s); using opsmath's kernel", e)
        return "opsmath"


def choose(q_shape, k_shape, dtype, device, bias_shape, mask_shape, mask_fill: float, is_causal: bool,
           scale: float, dropout_p: float, vendors: bool = True, softcap: float = 0.0, window: int = 0) -> str:
    """Measure and return the fastest correct implementation for these shapes (see module doc);
    ``vendors=False`` (a bias that needs its gradient) tunes opsmath's block configurations only.
    Runs outside the caller's autocast (which would turn the fp32 reference into bf16) and grad mode, its
    probes' warnings (SDPA's, for each backend that cannot take the inputs) silenced."""
    try:
        with torch.autocast(device.type, enabled=False), torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return _choose(q_shape, k_shape, dtype, device, bias_shape, mask_shape, mask_fill, is_causal, scale,
                           dropout_p, vendors and not softcap, softcap, window)
    finally:   # the random inputs and the fp32 reference are gone: give their blocks back
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _choose(q_shape, k_shape, dtype, device, bias_shape, mask_shape, mask_fill, is_causal, scale, dropout_p,
            vendors, softcap=0.0, window=0):
    q, k, v, bias, mask = _random_inputs(q_shape, k_shape, dtype, device, bias_shape, mask_shape)
    key = bucket_key(q, k, bias is not None, mask is not None, is_causal, dropout_p, softcap, window) \
        + ("" if vendors else OWN_ONLY)
    dout = torch.randn(q_shape, device=device, dtype=dtype)
    seed = torch.tensor(1234, dtype=torch.int64, device=device)
    vbias = fold_bias(bias, mask, is_causal, q.shape[2], k.shape[2], window, device)

    def run(name, q, k, v, bias, mask, vbias, p):
        if name == "ref":
            return attention_reference(q, k, v, bias, mask, mask_fill, is_causal, scale, p, 0, softcap, window)[0]
        if name == "eager":
            return eager_same_dtype(q, k, v, bias, mask, mask_fill, is_causal, scale, softcap=softcap, window=window)
        if name == "opsmath":
            return attention_op(q, k, v, bias, mask, mask_fill, is_causal, scale, p, seed, softcap, window)[0]
        return sdpa(q, k, v, vbias, is_causal and vbias is None, scale, p, name)

    configs = configs_for(q.shape[-1])

    def fwd_bwd(name, cfg=None):
        def step():
            with forced_config(cfg):
                return torch.autograd.grad(run(name, q, k, v, bias, mask, vbias, dropout_p), (q, k, v), dout)
        return step

    candidates = {}   # measured in this order: the vendors, then opsmath's kernel in each block configuration
    if vendors and vendor_eligible(device, mask_fill, False):
        for name in accurate_backends(run, q, k, v, bias, mask, vbias, dout):
            candidates[name] = fwd_bwd(name)
    plain = bias is None and mask is None and not window and not softcap
    args = (q, k, v, bias, mask, mask_fill, is_causal, scale, dropout_p, seed, softcap, window)
    fresh = cached("attention", key) is None and not (plain and any(n in candidates for n in FAST_VENDORS))
    # beside a vendor kernel, the other configurations compile only once the tuner reaches them (the vendor
    # may beat the default by OWN_CONFIG_GAIN and leave them untimed); alone, all compile at once
    later = _once(lambda: compile_ahead(configs[1:], args, dout)) if fresh and candidates else None
    own = {(_after(later, fwd_bwd("opsmath", c)) if later and c != configs[0] else fwd_bwd("opsmath", c)): c
           for c in configs}
    candidates.update({("opsmath" if c == configs[0] else config_name(c)): fn for fn, c in own.items()})
    per_config = {}   # each own configuration's kernels as measured: the per-kernel choice below

    def timed(fn):   # ``measure``, keeping each own configuration's kernel times
        return measure(fn, on_kernels=(lambda per: per_config.update({own[fn]: per})) if fn in own else None)
    if fresh:   # all at once, or beside a vendor the default only (always timed); counted as the candidates'
        t0 = time.perf_counter()   # first calls, where the lazy path's compile falls
        compile_ahead(configs[:1] if later else configs, args, dout)
        spent = time.perf_counter() - t0
        SPENT["seconds"], SPENT["first_calls"] = SPENT["seconds"] + spent, SPENT["first_calls"] + spent
    choice = pick("attention", key, candidates, timed, skip=lambda n, t: own_configs_cannot_win(n, t, plain))
    tiles = tiles_entry(per_config)
    if tiles and choice.startswith("opsmath"):   # measured now: each kernel launches in its fastest
        store(TILES, key, tiles)
    return "opsmath" if choice.startswith("opsmath") else choice   # its configurations: see launch_cfg


# The most any block configuration of opsmath's kernel has gained over its default (H200, 2026-11-29:
# D64, 1.43 -> 0.95 ms). Once the default is slower than the best vendor by this much, the other
# configurations cannot win, and compiling and timing them (~10 s each on a cold Triton cache: most of
# the 42.6 s GPT-2's first step spent capturing on 2026-11-29) is skipped.
OWN_CONFIG_GAIN = 1.5
# Plain attention (no bias, mask, window or softcap): opsmath's kernel measured 0.30-0.98x flash's and
# 0.22-0.53x cuDNN's TFLOP/s (H200, BENCHMARKS.md; 1.64x and 1.80x cuDNN's time in the fleet's tuning
# cache). Where either measured accurate, opsmath's kernel is not compiled at all: 3.4-4.5 s of Triton
# compiles per plain shape at the first step.
FAST_VENDORS = ("sdpa_cudnn", "sdpa_flash")


def compile_ahead(configs, args: tuple, dout: torch.Tensor) -> None:
    """Compile opsmath's three kernels (forward, dQ, dK/dV) in every block configuration at once, one thread
    per kernel and configuration, before the tuner times them one by one: Triton's compile spends most of
    its time outside the GIL (LLVM, ptxas; four kernels on a 2-core CPU: 7.15 s one after another, 3.59 s in
    two threads), and a cold compile is 3.3-5.4 s per configuration (H200 host) against 0.1 s of timing.
    Each thread makes its one launch on the tuner's random inputs (``args``: ``attention_op``'s; the
    backward kernels on an unwritten output and row statistics of the forward's shapes: what is compiled
    depends on dtypes, alignment and the constant arguments only; results dropped) with its configuration
    forced for that thread alone. A configuration that fails here (out of shared memory) fails again where
    the tuner meets it. Where a vendor kernel is a candidate, ``_choose`` compiles the default
    configuration ahead (it is always timed) and the others only when the tuner reaches the first of them
    (the vendor may have beaten the default by ``OWN_CONFIG_GAIN`` and left them untimed: a cold BERT-shaped
    tuning compiled four configurations and chose cuDNN, ``results/first_call-20261205.*``). CUDA only."""
    q = args[0]
    if q.device.type != "cuda" or not configs:
        return
    B, H, Sq, D = q.shape

    def one(job):
        cfg, kernel = job
        _AHEAD.cfg = cfg
        try:   # (a new thread's current device is the first GPU: launches go to the inputs')
            with torch.no_grad(), torch.cuda.device(q.device):
                if kernel == "fwd":
                    attention_forward_triton(*args)
                else:
                    out = torch.empty_like(q, memory_format=torch.contiguous_format)
                    stats = torch.empty((B, H, Sq, 2), device=q.device, dtype=torch.float32)
                    attention_backward_triton(dout, *args[:3], out, stats, *args[3:10], False, *args[10:],
                                              kernels=(kernel,))
        except Exception:   # noqa: BLE001 (the tuner's own launch reports it)
            pass
        finally:
            _AHEAD.cfg = None
    jobs = [(cfg, kernel) for cfg in configs for kernel in KERNELS]
    with ThreadPoolExecutor(max_workers=_ahead_workers(q, args[1], len(jobs))) as pool:
        list(pool.map(one, jobs))
    torch.cuda.synchronize(q.device)


def _ahead_workers(q: torch.Tensor, k: torch.Tensor, jobs: int) -> int:
    """Threads for ``compile_ahead``: one per job, at most one per CPU, and at most as many as a quarter of
    the memory the process may still allocate holds one launch's buffers for (each thread allocates the
    outputs of its launch: at most O, dQ and the row statistics of Q's size, dK and dV of K's; at T = 65536
    one thread's are gigabytes, and a first step under a memory budget may run on an emulated smaller card)."""
    per_job = 3 * q.numel() * q.element_size() + 2 * k.numel() * k.element_size() + 8 * q.numel() // q.shape[-1]
    try:
        free, total = torch.cuda.mem_get_info(q.device)
        cached = torch.cuda.memory_reserved(q.device) - torch.cuda.memory_allocated(q.device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(q.device)   # (newer torch)
        room = max(0, min(free + cached, fraction * total - torch.cuda.memory_allocated(q.device)))
    except Exception:   # noqa: BLE001 (memory not readable here: one thread, as the tuner's own launches)
        return 1
    return max(1, min(jobs, os.cpu_count() or 1, int(room // (4 * max(per_job, 1)))))


def _once(fn):
    """``fn`` that runs at its first call only (a raise included: the caller's candidate fails with it)."""
    done = []

    def once():
        if not done:
            done.append(True)
            fn()
    return once


def _after(first, fn):
    """``fn`` preceded by ``first()`` (a ``_once``) at every call."""
    def step():
        first()
        return fn()
    return step


def own_configs_cannot_win(name: str, times: dict[str, float], plain: bool = False) -> bool:
    """``pick``'s skip rule: leave out opsmath's non-default block configurations when its default
    configuration took ``OWN_CONFIG_GAIN`` times the fastest vendor kernel's time or more; for ``plain``
    attention, every configuration of it once cuDNN or flash has been measured."""
    if plain and name.startswith("opsmath") and any(v in times for v in FAST_VENDORS):
        return True
    vendor = [t for n, t in times.items() if not n.startswith("opsmath")]
    return name.startswith("opsmath:") and "opsmath" in times and bool(vendor) \
        and times["opsmath"] >= OWN_CONFIG_GAIN * min(vendor)


def _random_inputs(q_shape, k_shape, dtype, device, bias_shape, mask_shape):
    q = torch.randn(q_shape, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(k_shape, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(k_shape, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(bias_shape, device=device, dtype=dtype) if bias_shape is not None else None
    mask = torch.rand(mask_shape, device=device) < 0.2 if mask_shape is not None else None
    if mask is not None:  # keep one column per row unmasked so no row is fully masked
        mask[..., 0] = False
    return q, k, v, bias, mask


# queries and keys the backends' accuracy check runs on (``accurate_backends``)
CHECK_LEN = 2048


def accurate_backends(run, q, k, v, bias, mask, vbias, dout) -> list[str]:
    """The SDPA backends that take these inputs and meet docs/design.md's rule against an fp32 reference,
    output and dQ/dK/dV: error <= 2x the same-dtype PyTorch error (scores and P @ V in q's dtype,
    softmax in fp32, as users write it: ``eager_same_dtype``) + 1e-3 x max|ref|.
    Checked with dropout off on the first batch, kv head 0 and at most two of its query heads (every
    (batch, head) computes the same function) and the first ``CHECK_LEN`` queries and keys (a causal or
    sliding-window structure anchored at position 0 stays what it is), so the fp32 reference stays
    small: at T = 65536 the full one would hold 16 GiB per score matrix, more than the step it tunes."""
    heads = min(q.shape[1] // k.shape[1], 2)   # query heads of kv head 0

    def cut(t, rows=True):
        if t is None:
            return None
        t = t[:1]
        t = t[:, :heads] if t.shape[1] > 1 else t
        t = t[..., :CHECK_LEN] if rows and t.shape[-1] > 1 else t   # keys (scores' last dim)
        return t[..., :CHECK_LEN, :] if t.shape[-2] > 1 else t
    sub = [cut(q, False).detach(), cut(k[:, :1], False).detach(), cut(v[:, :1], False).detach()]
    b, m, vb, do = cut(bias), cut(mask), cut(vbias), cut(dout, False)

    def grads(name, dt):   # "ref": fp32 throughout; "eager": matmul-softmax-matmul in q's dtype
        x = [t.detach().clone().to(dt).requires_grad_() for t in sub]   # fresh leaves: no grad accumulation
        out = run(name, *x, b, m, vb, 0.0)
        out.backward(do.to(out.dtype))
        return [out.detach().float()] + [t.grad.float() for t in x]

    ref = grads("ref", torch.float32)
    eager = grads("eager", q.dtype)
    ok = []
    for name in BACKENDS:
        try:
            got = grads(name, q.dtype)
        except Exception:  # backend does not take these inputs (head dim, mask, dtype, GPU)
            continue
        if all(torch.isfinite(g).all() and (g - r).abs().max() <= 2 * (o - r).abs().max() + 1e-3 * r.abs().max()
               for g, o, r in zip(got, eager, ref)):
            ok.append(name)
    return ok


def eager_same_dtype(q, k, v, bias, mask, mask_fill, is_causal, scale, dropout_p=0.0, seed=0, softcap=0.0, window=0):
    """Attention as user code computes it, in q's dtype (docs/design.md's same-dtype yardstick): scores and
    P @ V in q's dtype, softmax in fp32 (or fp64), GQA by repeating K/V; dropout with opsmath's mask;
    Gemma-2's softcap ``softcap * tanh(S / softcap)`` before bias and masks; a sliding ``window`` removes
    keys ``j <= i - window``."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-2, -1)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias.to(s.dtype)
    if mask is not None:
        s = s.masked_fill(mask, mask_fill)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if window > 0:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(-window), float("-inf"))
    p = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), -1).to(q.dtype)
    if dropout_p > 0:
        p = p * dropout_keep(seed, flat_offsets(p.shape, p.device), dropout_p) / (1 - dropout_p)
    return p @ v


def fold_bias(bias, mask, is_causal: bool, Sq: int, Sk: int, window: int = 0, device=None):
    """The additive bias SDPA gets: ``bias`` with ``-inf`` where ``mask`` (and above the diagonal when
    causal and a bias, a mask or a window exists; left of a sliding ``window``, built on ``device``);
    ``None`` when there is neither bias, mask nor window."""
    if window > 0:
        left = torch.ones(Sq, Sk, dtype=torch.bool, device=device).tril(-window)
        mask = left if mask is None else mask | left
    if bias is None and mask is None:
        return None
    out = torch.zeros((), device=mask.device) if bias is None else bias.to(
        torch.promote_types(bias.dtype, torch.float32))
    if mask is not None:
        out = out.masked_fill(mask, float("-inf")) if out.dim() else torch.zeros(
            mask.shape, device=mask.device).masked_fill(mask, float("-inf"))
    if is_causal:
        upper = torch.ones(Sq, Sk, dtype=torch.bool, device=out.device).triu(1)
        out = out.masked_fill(upper, float("-inf"))
    return out


# H200, bf16, GPT-2-small's attention (B8 H12 T1024 D64, causal): cuDNN's forward ran 0.098 ms a call, 132
# TFLOP/s of the causal FLOPs, a third of the GEMM rate the recompute cost model assumes
# (results/profile_gap-budgets-20261201.log); the planner costs an attention recompute at that rate
SPEC = register(OpSpec("attention", ops=(torch.ops.opsmath.attention.default, sdpa), flops=attention_flops,
                       efficiency=0.33, exercise=exercise,
                       profile=("attention", ("_attn_", "opsmath::attention", "softmax", "flash", "fmha",
                                              "attention")),
                       saves="q, k, v, its output and fp32 row statistics; eager keeps the S x S probabilities"))
