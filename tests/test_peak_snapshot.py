"""``benchmarks/peak_snapshot.py``'s reading of an allocator trace (the GPU run itself needs CUDA)."""
from benchmarks.peak_snapshot import peak_live


def _ev(action, addr, mib, name="f"):
    return dict(action=action, addr=addr, size=int(mib * 2**20),
                frames=[dict(filename="/x/torch/nn/modules/module.py", line=1, name="_call_impl"),
                        dict(filename="/x/transformers/models/m.py", line=7, name=name)])


def test_the_live_set_at_the_highest_point_and_frees_of_older_blocks_ignored():
    trace = [_ev("free_completed", 99, 50),                      # allocated before the trace: not counted
             _ev("alloc", 1, 10, "a"), _ev("alloc", 2, 30, "b"), _ev("free_requested", 1, 10),
             _ev("free_completed", 1, 10), _ev("alloc", 3, 5, "c"),   # 35 MiB: the peak is 40, at a and b
             _ev("free_completed", 2, 30), _ev("alloc", 4, 20, "d")]
    out = peak_live(trace, top=2)
    assert out["peak_mib"] == 40
    assert [e["mib"] for e in out["live"]] == [30, 10]
    assert out["live"][0]["frames"] == ["models/m.py:7 b"]   # torch's own frames left out


def test_a_late_peak_and_the_timeline():
    from benchmarks.peak_snapshot import timeline
    trace = [_ev("alloc", 1, 30, "a"), _ev("free_completed", 1, 30), _ev("alloc", 2, 10, "b"),
             _ev("alloc", 3, 5, "c")]
    assert peak_live(trace)["peak_mib"] == 30
    late = peak_live(trace, after=2)
    assert late["peak_mib"] == 15 and [e["mib"] for e in late["live"]] == [10, 5]
    assert timeline(trace, points=4) == [30.0, 0.0, 10.0, 15.0]
