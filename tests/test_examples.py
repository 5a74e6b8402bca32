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
