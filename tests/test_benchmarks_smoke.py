"""The GPU benchmark scripts run end to end at toy size on CPU (``--smoke``): device time is scarce, so a
script that would crash there is caught here. They measure nothing in this mode and write no results."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow   # left out of the quick run (README: -m "not slow")

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


@pytest.mark.parametrize("args", [
    ["train.py", "--smoke"],
    ["hf_default_attention.py", "--smoke"],
    ["varying_lengths.py", "--smoke"],
    ["varying_lengths.py", "--smoke", "--model", "bloom4"],
    ["activations.py", "--smoke"],
    ["cross_entropy.py", "--smoke"],
    ["learning_curve.py", "--smoke"],
    ["fp8_curve.py", "--smoke"],
    ["fp8_curve.py", "--smoke", "--model", "gpt2", "--fp8-min-dim", "16", "--data-vocab", "64", "--no-torchao", "--amp"],
    ["memory.py", "--smoke", "--quick", "--paths", "op-by-op", "--lengths", "64,128"],
    ["memory.py", "--smoke", "--model", "llama", "--no-long", "--no-anchors", "--paths", "op-by-op",
     "--fractions", "0.5"],
    ["inductor_partition.py", "--smoke"],
    ["sass_stats.py", "--op", "dropout_add_norm", "--width", "256", "--config", "1"],
    ["dynamic_guards.py", "--inductor", "0"],
    ["moe.py", "--smoke", "--variants", "torch.compile,opsmath.optimize"],
    ["moe.py", "--smoke", "--curve", "3"],
    ["multi_gpu.py", "--smoke"],
], ids=lambda a: a[0])
def test_benchmark_script_smoke(args, tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), OPSMATH_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, *args], cwd=BENCH, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def test_exposed_communication_from_a_trace():
    """multi_gpu.py's exposed NCCL time: kernels read from a Chrome trace, NCCL time not covered by any
    compute kernel (compute intervals merged first)."""
    import sys
    sys.path.insert(0, BENCH)
    from multi_gpu import kernels_of, overlap_ms
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "ampere_gemm", "ts": 0, "dur": 100},
        {"cat": "kernel", "name": "triton_fused", "ts": 80, "dur": 40},        # merged: 0-120
        {"cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 100, "dur": 50},   # 20 us covered
        {"cat": "cpu_op", "name": "nccl:all_reduce", "ts": 0, "dur": 500},     # host event: not a kernel
        {"cat": "kernel", "name": "ncclKernel_AllGather", "ts": 200, "dur": 10}]}   # not covered
    total, exposed = overlap_ms(kernels_of(trace))
    assert abs(total - 0.060) < 1e-9 and abs(exposed - 0.040) < 1e-9, (total, exposed)
