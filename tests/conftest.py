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


# The quick subset (``python -m pytest -q -m quick tests``, a few minutes on two cores): unit tests of the
# rules, planner, optimizer, tuning cache and API, every family on small hand-written modules, and the
# autocast and HF-default paths on 2-layer models. The whole suite adds the kernels in Triton's interpreter,
# Inductor on CPU, the real-model zoo, the benchmark smoke runs and the notebooks.
QUICK = {
    "test_rules", "test_declare", "test_plan_solve", "test_attention_masks", "test_autotune",
    "test_autotune_database", "test_optim_state", "test_patterns_norms", "test_patterns_attention",
    "test_patterns_activations", "test_unmatched", "test_user_errors", "test_dynamo_backend", "test_outer_compile",
    "test_autocast", "test_inference_in_training", "test_buffer_guards", "test_dropout_seeds", "test_op_times",
    "test_examples", "test_patterns_attention_spellings", "test_layout",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in QUICK:
            item.add_marker(pytest.mark.quick)
