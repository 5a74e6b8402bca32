"""``benchmarks/triton_caches.py``: a kernel a Triton cache holds under two keys is found, and what
differs between its entries is named (options, then the TTIR signature's arguments)."""
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
from benchmarks.triton_caches import summarize  # noqa: E402


def _entry(root, key, name, options, signature):
    folder = os.path.join(root, key)
    os.makedirs(folder)
    with open(os.path.join(folder, name + ".json"), "w") as f:
        json.dump(dict(options, hash=key, name=name, triton_version="3.6.0"), f)
    with open(os.path.join(folder, name + ".ttir"), "w") as f:
        f.write("module {\n  tt.func public @%s(%s) loc(#loc)\n}\n" % (name, signature))


def test_kernels_held_twice_and_what_differs(tmp_path):
    root = str(tmp_path)
    a = "%arg0: !tt.ptr<bf16> {tt.divisibility = 16 : i32}, %arg1: i32"
    _entry(root, "K1", "attn_fwd", dict(num_warps=4, num_stages=3), a)
    _entry(root, "K2", "attn_fwd", dict(num_warps=8, num_stages=3), a.replace(", %arg1: i32", ", %arg1: i32 {tt.divisibility = 16 : i32}"))
    _entry(root, "K3", "attn_fwd", dict(num_warps=4, num_stages=3), a)
    _entry(root, "K4", "other", dict(num_warps=4, num_stages=3), a)
    _entry(root, "K5", "triton_poi_fused_add_0", dict(num_warps=4, num_stages=1), a)   # Inductor's: its
    _entry(root, "K6", "triton_poi_fused_add_0", dict(num_warps=8, num_stages=1), a)   # configs, by design
    s = summarize(root)
    assert (s["entries"], s["kernels"]) == (4, 2) and list(s["twice"]) == ["attn_fwd"]
    second, third = s["twice"]["attn_fwd"]
    assert second[0] == "option num_warps: 4 vs 8" and second[1].startswith("argument 1:")
    assert third == ["nothing in the options or the signature (the source or a global differs)"]
    assert summarize(root, match="other")["twice"] == {}
    assert summarize(str(tmp_path / "absent"))["entries"] == 0
