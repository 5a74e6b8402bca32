"""The attention kernels' launch configuration under symbolic sizes: traced into a graph whose lengths
change (a ``triton_op`` under Inductor), choosing tiles reads the example sizes and adds no guard."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from opsmath.kernels.attention.configs import bucket_key


def test_bucket_of_symbolic_sizes_is_the_examples_and_adds_no_guard():
    keys, sizes = [], []

    def traced(q, k):
        sizes.append(q.shape[2])
        keys.append(bucket_key(q, k, False, False, True, 0.0, 0.0, 128))
        return q * 2
    q, k = torch.empty(3, 8, 300, 64, dtype=torch.bfloat16), torch.empty(3, 2, 300, 64, dtype=torch.bfloat16)
    gm = make_fx(traced, tracing_mode="symbolic")(q, k)
    assert isinstance(sizes[0], torch.SymInt)
    assert keys[0] == bucket_key(q, k, False, False, True, 0.0, 0.0, 128)
    assert "Sq<=512" in keys[0] and "H/Hkv=4" in keys[0]
    assert not gm.shape_env.guards, gm.shape_env.guards
