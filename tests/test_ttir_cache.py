"""The TTIR analysis of opsmath's Triton kernels runs once per distinct launch (``runtime/ttir_cache``) and
answers as the analysis itself does. On a CPU machine Triton's front end builds TTIR for a faked sm_90
target (no device is touched); the kernels here are built as ``JITFunction``s, not interpreted ones."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from torch._higher_order_ops import triton_kernel_wrap as wrap  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from opsmath.runtime import ttir_cache  # noqa: E402


def _scale_rows(X, Y, N, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N) * scale, mask=offs < N)


class _Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def _with_sm90_target(fn):
    """``fn()`` with Triton's active driver answering an sm_90 target (no device is touched)."""
    active = triton.runtime.driver._active
    triton.runtime.driver.set_active(_Sm90())
    try:
        return fn()
    finally:
        triton.runtime.driver._active = active


def _kernel(module: str) -> JITFunction:
    # a fresh function object per kernel, its module named as the kernel's owner's would be
    fn = type(_scale_rows)(_scale_rows.__code__, _scale_rows.__globals__, "_scale_rows")
    fn.__module__, fn.__annotations__ = module, dict(_scale_rows.__annotations__)
    return JITFunction(fn)


def _args(dtype):
    with FakeTensorMode():
        x, y = torch.empty(64, dtype=dtype), torch.empty(64, dtype=dtype)
    return dict(X=x, Y=y, N=64, scale=0.5, BLOCK=32)


def _writes(accesses):
    return sorted(d.name for d in accesses.read_writes.writes)


def _probe() -> dict:
    """What the cached analysis answers and counts, for an opsmath kernel and a user's (run in a process of
    its own: Triton's interpreter, which the other tests run in, leaves ``triton.language`` unfit for
    building TTIR in the process that used it)."""
    ttir_cache.install()
    analysis = wrap.identify_accessed_tensors
    ours, users = _kernel("opsmath.kernels.example"), _kernel("user_model.kernels")
    counts = lambda: dict(ttir_cache.STATS)  # noqa: E731
    out = dict(start=counts())
    first = analysis(ours, _args(torch.bfloat16), {})
    again = analysis(ours, _args(torch.bfloat16), {})
    out.update(first=_writes(first), again=_writes(again), fresh=_writes(analysis.__wrapped__(ours, _args(
        torch.bfloat16), {})), copied=again is not first and again.read_writes is not first.read_writes,
        after_two=counts())
    analysis(ours, _args(torch.float32), {})                 # another dtype: analyzed again
    analysis(ours, dict(_args(torch.bfloat16), N=65), {})    # another size: analyzed again
    out["after_four"] = counts()
    out["users"] = [_writes(analysis(users, _args(torch.bfloat16), {})) for _ in range(2)]
    out["after_users"] = counts()
    out["layers"] = _three_attention_layers(analysis)
    return out


def _three_attention_layers(analysis) -> dict:
    """AOTAutograd's functional graph of three attention layers of one shape on fake CUDA tensors (each launch
    its own ``Autotuner`` around the kernel), with the cached analysis and with torch's own."""
    import opsmath.kernels.attention  # noqa: F401  (registers the ops)
    from torch._functorch.aot_autograd import aot_export_joint_simple
    B, T, H, Hkv, D = 2, 64, 4, 2, 32

    def layers(x, *ws):
        for wq, wkv in zip(ws[::2], ws[1::2]):
            q = (x @ wq).view(B, T, H, D).transpose(1, 2)
            k, v = (x @ wkv).view(B, T, 2 * Hkv, D).transpose(1, 2).chunk(2, dim=1)
            out, _ = torch.ops.opsmath.attention(q, k, v, None, None, float("-inf"), True, D ** -0.5, 0.0, None,
                                                 0.0, 16)
            x = x + out.transpose(1, 2).reshape(B, T, H * D)
        return (x,)

    def export():
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.randn(B, T, H * D, device="cuda", dtype=torch.bfloat16)
            ws = [torch.randn(H * D, n, device="cuda", dtype=torch.bfloat16) for _ in range(3)
                  for n in (H * D, 2 * Hkv * D)]
            return aot_export_joint_simple(layers, [x, *ws], trace_joint=False).code
    before = dict(ttir_cache.STATS)
    cached = export()
    counts = {k: ttir_cache.STATS[k] - before[k] for k in before}
    wrap.identify_accessed_tensors = analysis.__wrapped__
    try:
        fresh = export()
    finally:
        wrap.identify_accessed_tensors = analysis
    side_table = re.compile(r"(kernel_idx|constant_args_idx) = \d+")   # indices into torch's side table
    return dict(counts=counts, same_graph=side_table.sub("", cached) == side_table.sub("", fresh),
                clones=cached.count("aten.clone"))


@pytest.fixture(scope="module")
def probe():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(wrap, "identify_accessed_tensors"), reason="torch names the analysis otherwise")
def test_an_opsmath_kernel_is_analyzed_once_per_launch_signature_and_answers_as_the_analysis(probe):
    assert probe["first"] == probe["again"] == probe["fresh"] == ["Y"]
    assert probe["after_two"] == dict(misses=probe["start"]["misses"] + 1, hits=probe["start"]["hits"] + 1)
    assert probe["copied"]                                      # a copy: callers may edit what they get
    assert probe["after_four"]["misses"] == probe["start"]["misses"] + 3


@pytest.mark.skipif(not hasattr(wrap, "identify_accessed_tensors"), reason="torch names the analysis otherwise")
def test_a_repeated_attention_launch_is_served_and_the_traced_graph_is_torchs(probe):
    layers = probe["layers"]
    assert layers["counts"]["misses"] == 1 and layers["counts"]["hits"] >= 2, layers   # 3 launches, 1 signature
    assert layers["same_graph"]
    assert layers["clones"] <= 2 * 3   # at most Out and Stats per launch: Q, K, V are not taken as written


@pytest.mark.skipif(not hasattr(wrap, "identify_accessed_tensors"), reason="torch names the analysis otherwise")
def test_a_users_kernel_keeps_torchs_uncached_analysis(probe):
    assert probe["users"] == [["Y"], ["Y"]]
    assert probe["after_users"] == probe["after_four"]


def test_an_argument_of_unknown_kind_is_not_keyed():
    assert ttir_cache.key(object(), dict(X=object()), {}) is None
    with FakeTensorMode():
        t = torch.empty(3)
    kernel = _kernel("opsmath.kernels.example")
    assert ttir_cache.key(kernel, dict(n=4, X=t), {}) == \
        ((id(kernel), ()), (("X", ("T", torch.float32, "FakeTensor")), ("n", ("int", 4))), "[]")


class _TwoLayers(torch.nn.Module):
    """Two sliding-window attention layers of one shape (a window runs opsmath's Triton kernel on CUDA, where
    plain causal attention runs cuDNN's): the second layer's launches repeat the first's."""
    def __init__(self, c=64, heads=2, window=32):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(c, 3 * c) for _ in range(2))

    def forward(self, x):
        B, T, C = x.shape
        i, j = torch.arange(T, device=x.device)[:, None], torch.arange(T, device=x.device)[None, :]
        keep = (j <= i) & (j > i - self.window)
        for qkv in self.qkv:
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in qkv(x).split(C, dim=2))
            x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep) \
                .transpose(1, 2).reshape(B, T, C)
        return x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor traces attention's triton_op on CUDA")
def test_on_the_gpu_a_repeated_layers_launches_are_analyzed_once_and_nothing_is_assumed_mutated(caplog):
    import opsmath
    opt = opsmath.optimize(_TwoLayers().cuda())
    x = torch.randn(2, 128, 64, device="cuda", requires_grad=True)
    before = dict(ttir_cache.STATS)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = opt(x)
    y.float().sum().backward()
    assert sum(m.pattern == "attention" for m in opsmath.report(opt).matches) == 2
    assert ttir_cache.STATS["hits"] > before["hits"], ttir_cache.STATS
    assert "assuming every input is mutated" not in caplog.text


if __name__ == "__main__":
    print(json.dumps(_with_sm90_target(_probe)))
