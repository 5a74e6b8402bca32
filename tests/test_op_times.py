"""Measured op times for the recompute costs (``src/opsmath/memory/op_times.py``): each distinct call measured
once on fresh inputs of its recorded layout, views and unmeasurable ops left to the model. On CPU with a
host timer (the GPU's is ``gpu_seconds``); ``annotate`` alone measures nothing off CUDA, nor on CUDA unless
``OPSMATH_MEASURED_COSTS=1``."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from opsmath.memory import op_times
from opsmath.memory.segments import forward_order, node_cost


def _graph(f, *args):
    return make_fx(f, tracing_mode="fake")(*args)


def _block(x, w, ids, table):
    h = torch.nn.functional.linear(x, w).relu()
    h = torch.nn.functional.linear(h, w).relu()           # the same calls again: measured once
    e = torch.nn.functional.embedding(ids, table)          # integer indices: zeros, in range
    return h.t().sum() + e.expand(2, *e.shape).mean()      # a view (t), a stride-0 input (expand)


@pytest.fixture(autouse=True)
def fresh():
    op_times._TIMES.clear()
    yield
    op_times._TIMES.clear()


def test_each_distinct_call_is_measured_once_and_replaces_the_model():
    gm = _graph(_block, torch.randn(8, 16), torch.randn(16, 16), torch.randint(0, 5, (7,)), torch.randn(5, 16))
    order = forward_order(gm)
    calls = []

    def timer(fn):
        fn()   # the op runs on fresh inputs; a wrong layout or index would raise here
        calls.append(1)
        return 1e-3 * len(calls)
    assert op_times.annotate(order) == 0          # CPU and no timer: nothing measured, the model stays
    modelled = {n.name: node_cost(n) for n in order}
    done = op_times.annotate(order, timer)
    timed = [n for n in order if op_times.MEASURED in n.meta]
    assert done == len(timed) and len(calls) == len({op_times.signature(n) for n in timed}) < len(timed)
    for n in order:
        if op_times.MEASURED in n.meta:
            assert node_cost(n) == n.meta[op_times.MEASURED] and n.meta[op_times.MEASURED] > 0
        else:
            assert node_cost(n) == modelled[n.name]
    assert not any(op_times.MEASURED in n.meta for n in order if getattr(n.target, "is_view", False))
    again = _graph(_block, torch.randn(8, 16), torch.randn(16, 16), torch.randint(0, 5, (7,)), torch.randn(5, 16))
    op_times.annotate(forward_order(again), timer)
    assert len(calls) == len({op_times.signature(n) for n in timed})   # the process remembers every call


def test_an_op_that_rejects_fresh_inputs_keeps_the_model():
    gm = _graph(lambda x: (x * 2).sum(), torch.randn(3, 4))

    def timer(fn):
        raise RuntimeError("not here")
    assert op_times.annotate(forward_order(gm), timer) == 0
    assert all(op_times.MEASURED not in n.meta for n in gm.graph.nodes)


def test_host_timer_measures_real_calls():
    gm = _graph(lambda a, b: a @ b, torch.randn(64, 64), torch.randn(64, 64))
    assert op_times.annotate(forward_order(gm), op_times.cpu_seconds) == 1
    (mm,) = [n for n in gm.graph.nodes if op_times.MEASURED in n.meta]
    assert 0 < mm.meta[op_times.MEASURED] < 1
    op_times.annotate(forward_order(gm), op_times.cpu_seconds, scale=lambda n: 0.25)   # the remembered time, scaled
    assert mm.meta[op_times.MEASURED] == 0.25 * op_times._TIMES[op_times.signature(mm)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_seconds_is_the_kernels_time_and_annotate_runs_on_cuda_graphs(monkeypatch):
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    s = op_times.gpu_seconds(lambda: a @ a)
    assert 2 * 4096 ** 3 / s / 1e12 < 2000        # under any GPU's bf16 peak: the kernel's time, not less
    small = torch.randn(1024, device="cuda")
    assert op_times.gpu_seconds(lambda: small + 1) < 20e-6   # no host dispatch in it
    gm = _graph(lambda x, w: torch.nn.functional.linear(x, w).relu(), torch.randn(256, 512, device="cuda"),
                torch.randn(512, 512, device="cuda"))
    assert op_times.annotate(forward_order(gm)) == 0          # opt-in
    monkeypatch.setenv("OPSMATH_MEASURED_COSTS", "1")
    assert op_times.annotate(forward_order(gm)) == 2
