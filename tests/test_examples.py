"""The recipes under ``examples/`` run as their docstrings say (CPU here): opsmath inside the user's
training framework, with its rewrites reported."""
import os
import runpy

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def test_hf_trainer_recipe_trains_with_the_rewrites():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    main = runpy.run_path(os.path.join(EXAMPLES, "hf_trainer.py"))["main"]
    report = main(steps=3)
    assert report.count("attention") == 2 and report.count("dropout_add_norm") == 4
    assert len(report.graphs) == 1 and report.graphs[0].calls == 3 and not report.fallback_errors


def test_hf_trainer_with_gradient_checkpointing_rewrites_inside_the_checkpointed_layers():
    """``gradient_checkpointing=True``: transformers 5's layers write the ``kernels`` package's context
    variable inside each checkpointed body, which dynamo's checkpoint refuses by default; opsmath traces it."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    main = runpy.run_path(os.path.join(EXAMPLES, "hf_trainer.py"))["main"]
    report = main(steps=3, gradient_checkpointing=True)
    assert report.count("attention") == 2 and report.count("swiglu") == 2 and not report.fallback_errors
    assert sum(r.kind == "checkpoint" for r in report.eager_regions) == 2, report.render(width=140)
    assert not any("side effect" in r.reason.lower() and r.kind == "graph break" for r in report.eager_regions)


def test_lightning_recipe_trains_with_the_rewrites():
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    report = runpy.run_path(os.path.join(EXAMPLES, "lightning_module.py"))["main"](steps=3)
    assert report.count("attention") == 2 and report.count("dropout_add_norm") == 4
    assert len(report.graphs) == 1 and report.graphs[0].calls == 3 and not report.fallback_errors


def test_accelerate_recipe_accumulates_with_the_rewrites():
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    report = runpy.run_path(os.path.join(EXAMPLES, "accelerate_loop.py"))["main"](steps=3, accumulate=2)
    assert report.count("attention") == 2 and report.count("dropout_add_norm") == 4
    assert len(report.graphs) == 1 and report.graphs[0].calls == 6 and not report.fallback_errors


def test_grad_scaler_recipe_trains_as_eager():
    """fp16 autocast + GradScaler + opsmath's fused AdamW: the losses of eager's same loop, step by step."""
    pytest.importorskip("transformers")
    main = runpy.run_path(os.path.join(EXAMPLES, "grad_scaler_loop.py"))["main"]
    report, losses = main(steps=4)
    _, eager = main(steps=4, optimized=False)
    assert report.count("attention") == 2 and not report.fallback_errors
    for a, b in zip(losses, eager):
        assert abs(a - b) <= 2e-3 * abs(b)


def test_torchtune_style_recipe_compiles_each_layer_and_steps_in_backward():
    """Per-layer ``compile(backend="opsmath")`` with the optimizer inside backward trains as eager with torch's
    AdamW after backward (losses and weights), each layer's attention rewritten."""
    pytest.importorskip("transformers")
    main = runpy.run_path(os.path.join(EXAMPLES, "torchtune_style.py"))["main"]
    model, losses, report = main(steps=3)
    eager, eager_losses, _ = main(steps=3, optimized=False)
    assert report.count("attention") == 1 and not report.fallback_errors
    assert all(p.grad is None for p in model.parameters())
    for a, b in zip(losses, eager_losses):
        assert abs(a - b) <= 1e-4 * abs(b)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert (p - q).abs().max() <= 1e-4
