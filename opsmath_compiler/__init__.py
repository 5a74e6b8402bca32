"""opsmath: make PyTorch training faster without rewriting the model.

    model = opsmath.optimize(model)      # same module, compiled in place with opsmath's backend
    loss = model(x, y); loss.backward()  # first call captures, rewrites attention / dropout-add-norm
    print(opsmath.report(model))         # what was replaced, where in the source, and what was not
"""
from .api import optimize
from .report import Report, report

__all__ = ["optimize", "report", "Report"]
__version__ = "0.1.0"
