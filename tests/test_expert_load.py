"""The experts' load ring (``kernels.grouped_mm.ExpertLoad``): slots chosen by a device-side counter, so
the last ``LOAD_STEPS`` calls come back oldest first after the ring wraps, and CUDA-graph replays (which
repeat the captured copy, not the Python around it) fill successive slots."""
import pytest
import torch

from opsmath.kernels.grouped_mm import LOAD_STEPS, ExpertLoad


def _offs(i, device="cpu"):
    return torch.tensor([i, 2 * i, 2 * i + 3], dtype=torch.int32, device=device)   # tokens i, i, 3


def test_ring_keeps_the_last_calls_oldest_first():
    load = ExpertLoad(3, "layer")
    assert load.calls == 0 and load.counts().shape == (0, 3)
    for i in range(LOAD_STEPS + 5):
        load.record(_offs(i))
    assert load.calls == LOAD_STEPS + 5
    counts = load.counts()
    assert counts[:, 0].tolist() == list(range(5, LOAD_STEPS + 5))
    assert (counts[:, 2] == 3).all() and (counts[:, 0] == counts[:, 1]).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_fill_successive_slots():
    load, offs = ExpertLoad(3, "layer"), _offs(1, "cuda")
    load.record(offs)                       # eager: the ring and counter exist before capture
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        load.record(offs)
    torch.cuda.current_stream().wait_stream(s)
    for i in (2, 3, 4):
        offs.copy_(_offs(i, "cuda"))
        graph.replay()
    assert load.calls == 4                  # capture records the copy without running it
    assert load.counts()[:, 0].tolist() == [1, 2, 3, 4]
