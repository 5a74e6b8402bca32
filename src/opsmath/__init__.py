"""opsmath: make PyTorch training faster without rewriting the model.

    model = opsmath.optimize(model)      # same module, compiled in place with opsmath's backend
    loss = model(x, y); loss.backward()  # first call captures, rewrites attention / dropout-add-norm
    print(opsmath.report(model))         # what was replaced, where in the source, and what was not

Exploring and checking: ``opsmath.explore(model, *inputs)`` (candidates, skip/enable, draw, emit),
``opsmath.verify(eager, optimized, *inputs)`` (numerics by docs/design.md's rule, loss curves),
``opsmath.profile(eager, optimized, *inputs)`` (kernels, time per op class, peak memory).
"""
from opsmath.api import optimize
from opsmath.memory.plan import InfeasibleBudget
from opsmath.ui.explore import Exploration, explore
from opsmath.ui.profile import ProfileResult, profile
from opsmath.ui.report import Report, report
from opsmath.ui.verify import VerifyResult, verify
from opsmath import optim  # noqa: E402  (opsmath.optim.AdamW, available after ``import opsmath``)

__all__ = ["optimize", "InfeasibleBudget", "report", "Report", "explore", "Exploration", "verify", "VerifyResult",
           "profile", "ProfileResult", "optim"]
__version__ = "0.1.0"
