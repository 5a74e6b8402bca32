"""opsmath.profile of a nanoGPT training step on the GPU (bf16 autocast): kernels per step, time per op
class, step time and peak memory, eager vs opsmath.optimize. A preview of the end-to-end numbers."""
import copy

import torch

import opsmath
from opsmath.examples import GPT
from benchmarks._harness import bench, write

torch.manual_seed(0)
B, T = 8, 1024
model = GPT(vocab_size=50304, block_size=T, n_layer=6, n_head=12, n_embd=768, dropout=0.1).cuda()
idx = torch.randint(0, 50304, (B, T), device="cuda")
batch = (idx, torch.roll(idx, -1, 1))
eager = copy.deepcopy(model)
opt = opsmath.optimize(model)


class Autocast(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, *a):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return self.m(*a)


res = opsmath.profile(Autocast(eager), Autocast(opt), *batch, steps=3)
print(res)
rows = []
for name, m in (("eager", eager), ("opsmath", opt)):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(*batch)
        loss.backward()
        m.zero_grad(set_to_none=True)
    r = bench(step, warmup_ms=200, rep_ms=1000)
    rows.append(dict(impl=name, ms=r["ms"], tokens_per_s=B * T / r["ms"] * 1e3, peak_gib=r["peak_bytes"] / 2**30))
    print(f"{name:8} {r['ms']:8.2f} ms/step {B * T / r['ms'] * 1e3:10.0f} tok/s peak {r['peak_bytes'] / 2**30:6.2f} GiB")
path = write("profile_step", dict(model="GPT 6x768 B8 T1024 bf16 autocast dropout 0.1", rows=rows,
                                  profile=[r.__dict__ for r in res.rows]))
print(opsmath.report(opt).render(width=100)[:1500])
print("wrote", path)
