"""Shared test setup.

On a machine without CUDA, Triton kernels run in its interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported). ``OPSMATH_TEST_DEVICE=cuda`` runs the device-parametrized tests on the GPU.
"""
import os

import torch

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
