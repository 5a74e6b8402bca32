"""Where the time of one opsmath dropout_add_norm fwd+bwd goes (torch.profiler, CUDA kernels), at a
narrow and a wide row: the numbers behind BENCHMARKS.md's note on small widths."""
import torch
from torch.profiler import ProfilerActivity, profile

import opsmath  # noqa: F401
from opsmath.kernels.dropout_add_norm import dropout_add_norm_op

for N in (768, 8192):
    x = torch.randn(16384, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        dropout_add_norm_op(x, r, w, None, True, 1e-6, 0.1, torch.randint(0, 2**31 - 1, ()), x.dtype)[0].backward(dy)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"--- N={N}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40))
