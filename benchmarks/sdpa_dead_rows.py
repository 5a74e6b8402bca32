"""What each SDPA backend returns for a query row whose every key is masked (left padding under a causal
mask), with the mask as a boolean ``attn_mask`` and as an additive bias holding ``-inf``, in bf16 on
the GPU: the output row and whether the gradients stay finite. opsmath's kernel returns 0 there.

    python benchmarks/sdpa_dead_rows.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from _harness import write


def main():
    torch.manual_seed(0)
    B, H, S, D = 1, 2, 128, 64
    keep = torch.ones(S, S, dtype=torch.bool, device="cuda").tril()
    keep[:, :4] = False                       # left padding: keys 0..3; rows 0..3 see nothing
    bias = torch.zeros(S, S, device="cuda", dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))
    rows = {}
    for name, be in [("math", SDPBackend.MATH), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        for kind, mask in [("bool", keep), ("-inf bias", bias)]:
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            try:
                with sdpa_kernel([be]):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    out.float().sum().backward()
                dead = out[0, :, :4].float()
                r = dict(dead_row_abs_max=dead.abs().max().item(), dead_row_nan=bool(dead.isnan().any()),
                         grads_finite=all(bool(t.grad.isfinite().all()) for t in (q, k, v)))
            except Exception as e:   # the backend does not take this mask
                r = dict(error=f"{type(e).__name__}: {str(e)[:80]}")
            rows[f"{name} {kind}"] = r
            print(f"{name:10} {kind:10} {r}", flush=True)
    print("wrote", write("sdpa_dead_rows", rows))


if __name__ == "__main__":
    main()
