"""``opsmath.verify``: numerics of an optimized model against eager, by docs/design.md's rule.

For the model's output and every parameter gradient::

    err(x)  = max |x - x_fp64|            x_fp64 from an fp64 copy of the eager model
    passes  = err(opsmath) <= 2 * err(eager) + atol * max(1, max |x_fp64|)     and no NaN

``nn.Dropout`` modules are set to ``p = 0`` for the comparison (dropout masks of two implementations
differ by construction); dropout spelled functionally with a fixed p is reported as a risk.
``steps=N`` also trains both for N SGD steps from the same weights and compares the loss curves.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
from rich.table import Table
from rich.text import Text

from opsmath.ui.rendering import Rendered


@dataclass
class Check:
    name: str
    shape: tuple
    err_opsmath: float
    err_eager: float
    tol: float
    ok: bool


@dataclass
class VerifyResult(Rendered):
    checks: list[Check]
    losses: dict = field(default_factory=dict)     # {"eager": [...], "opsmath": [...]}
    max_loss_rel_diff: float | None = None

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def verdict(self) -> str:
        bad = [c.name for c in self.checks if not c.ok]
        return "PASS" if not bad else f"FAIL ({len(bad)} of {len(self.checks)}: {', '.join(bad[:3])})"

    def __rich_console__(self, console, options):
        t = Table(title="opsmath.verify vs eager (reference: fp64 eager)", box=None, padding=(0, 1))
        for col, just in (("tensor", "left"), ("err opsmath", "right"), ("err eager", "right"),
                          ("bound", "right"), ("", "left")):
            t.add_column(col, justify=just, overflow="fold")
        for c in self.checks:
            t.add_row(c.name, f"{c.err_opsmath:.2e}", f"{c.err_eager:.2e}", f"{2 * c.err_eager + c.tol:.2e}",
                      Text("ok", style="green") if c.ok else Text("FAIL", style="bold red"))
        yield t
        if self.losses:
            yield Text(f"{len(self.losses['eager'])} training steps: max relative loss difference "
                       f"{self.max_loss_rel_diff:.2e}")
        yield Text(f"verdict: {self.verdict}", style="bold green" if self.ok else "bold red")

    def plot_losses(self, ax=None):
        """The two loss curves (matplotlib); returns the Axes."""
        import matplotlib.pyplot as plt
        if ax is None:
            _, ax = plt.subplots(figsize=(6, 3.5))
        for name, ys in self.losses.items():
            ax.plot(range(1, len(ys) + 1), ys, label=name, linestyle="-" if name == "eager" else "--")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        return ax


@contextlib.contextmanager
def _dropout_off(*models):
    saved = []
    for m in models:
        for mod in m.modules():
            if isinstance(mod, torch.nn.modules.dropout._DropoutNd):
                saved.append((mod, mod.p))
                mod.p = 0.0
    try:
        yield
    finally:
        for mod, p in saved:
            mod.p = p


def _to64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().double()
    return x


def _scalar(out, weights: dict):
    """A scalar to differentiate: the output if it is one (a loss), else a fixed random projection."""
    if hasattr(out, "loss") and out.loss is not None:
        out = out.loss
    elif hasattr(out, "logits"):
        out = out.logits
    elif isinstance(out, (tuple, list)):
        out = out[0]
    if out.dim() == 0:
        return out, out
    if "w" not in weights:
        g = torch.Generator().manual_seed(0)
        weights["w"] = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device)
    return (out * weights["w"].to(out.dtype)).sum(), out


def _max_err(a, ref) -> float:
    return (a.double() - ref.double()).abs().max().item() if a.numel() else 0.0


def verify(model: torch.nn.Module, optimized: torch.nn.Module, *inputs, atol: float = 1e-5,
           steps: int = 0, lr: float = 1e-2) -> VerifyResult:
    """Compare ``optimized`` (from ``opsmath.optimize``) with the eager ``model`` it was made from (a copy
    taken before ``optimize``; same weights). Returns a :class:`VerifyResult`; ``print`` it for the table.
    """
    if model is optimized:
        raise ValueError("verify needs the eager model and the optimized one as two objects: "
                         "take `eager = copy.deepcopy(model)` before `opsmath.optimize(model)`")
    ref = copy.deepcopy(model).double()
    checks: list[Check] = []
    weights: dict = {}
    with _dropout_off(model, optimized, ref):
        outs = {}
        for name, m, args in (("opsmath", optimized, inputs), ("eager", model, inputs),
                              ("ref", ref, tuple(_to64(a) for a in inputs))):
            m.zero_grad(set_to_none=True)
            loss, out = _scalar(m(*args), weights)
            loss.backward()
            outs[name] = out.detach()
        checks.append(_check("output", outs["opsmath"], outs["eager"], outs["ref"], atol))
        for (pname, p), pe, pr in zip(optimized.named_parameters(), model.parameters(), ref.parameters()):
            if pr.grad is None:
                continue
            if p.grad is None or pe.grad is None:
                checks.append(Check(f"grad {pname}", tuple(p.shape), float("nan"), float("nan"), 0.0, False))
                continue
            checks.append(_check(f"grad {pname}", p.grad, pe.grad, pr.grad, atol))
        result = VerifyResult(checks)
        if steps:
            result.losses = {"eager": _train(model, inputs, steps, lr, weights),
                             "opsmath": _train(optimized, inputs, steps, lr, weights)}
            result.max_loss_rel_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in
                                           zip(result.losses["opsmath"], result.losses["eager"]))
    for m in (model, optimized):
        m.zero_grad(set_to_none=True)
    return result


def _check(name, got, eager, ref, atol) -> Check:
    e_o, e_e = _max_err(got, ref), _max_err(eager, ref)
    tol = atol * max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    ok = bool(torch.isfinite(got).all()) and e_o <= 2 * e_e + tol
    return Check(name, tuple(got.shape), e_o, e_e, tol, ok)


def _train(model, inputs, steps, lr, weights) -> list[float]:
    """SGD from a copy of the current weights (the caller's weights are left unchanged)."""
    state = copy.deepcopy(model.state_dict())
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        sgd.zero_grad(set_to_none=True)
        loss, _ = _scalar(model(*inputs), weights)
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    model.load_state_dict(state)
    return losses
