"""Shared test setup.

On a machine without CUDA, Triton kernels run in its interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported). ``OPSMATH_TEST_DEVICE=cuda`` runs the device-parametrized tests on the GPU.
"""
import os
import sys

# ``python -m pytest`` from the repository root puts the root on sys.path, where the source folder
# ``kernels/`` would shadow Hugging Face's ``kernels`` package: transformers probes for it
# (``importlib.util.find_spec("kernels")``) and imported opsmath's kernels a second time as a top-level
# package. opsmath itself is imported as installed (``opsmath.kernels``); the root is not needed.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = os.environ.get("OPSMATH_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Route CPU tensors through the Triton kernels (interpreter) instead of the PyTorch reference.
    On a CUDA machine the kernels are compiled for the GPU and CUDA tensors reach them anyway."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("OPSMATH_TRITON_ON_CPU", "1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
