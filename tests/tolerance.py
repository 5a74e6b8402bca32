"""docs/design.md's tolerance rule (the FlashAttention rule).

The fused result and the same-dtype PyTorch result are both compared with a higher-precision
reference; the fused error must be at most ``2 x`` PyTorch's error plus a small ``atol``, taken
relative to the reference's largest magnitude (a dV of magnitude 20 summed over 257 rows in fp32 carries
~1e-5 of rounding whatever the summation order). NaN never passes.
"""
import torch


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item()


def assert_rule(fused: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor, atol: float = 1e-5, name: str = ""):
    assert fused.shape == ref.shape, f"{name}: shape {tuple(fused.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(fused).any(), f"{name}: NaN in fused result"
    ef, ee = max_err(fused, ref), max_err(eager, ref)
    tol = atol * max(1.0, ref.abs().max().item())
    assert ef <= 2 * ee + tol, f"{name}: fused error {ef:.3g} > 2 x eager error {ee:.3g} + {tol:.3g}"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def grads_close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float = 1e-7) -> bool:
    """``||a - b|| <= rtol ||b|| + atol``: relative, except for gradients that are zero in exact
    arithmetic (a key projection's bias under softmax) where only rounding noise remains."""
    return (a.double() - b.double()).norm().item() <= rtol * b.double().norm().item() + atol


def optimized_matches_eager(model, *inputs):
    """``opsmath.optimize(model)`` against a deep copy run eagerly on ``inputs`` (fp32): the output within
    1e-5 and every parameter's gradient within 1e-4 (relative, in norm) of eager's, for one random
    weighting of the output. Returns the report."""
    import copy

    import opsmath
    eager = copy.deepcopy(model)
    opt = opsmath.optimize(model)
    y1, y2 = opt(*inputs), eager(*inputs)
    w = torch.randn_like(y1)
    (y1 * w).sum().backward()
    (y2 * w).sum().backward()
    assert rel_err(y1, y2) < 1e-5
    for (n, p1), p2 in zip(opt.named_parameters(), eager.parameters()):
        assert rel_err(p1.grad, p2.grad) < 1e-4, n
    return opsmath.report(opt)
