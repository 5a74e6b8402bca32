"""The notebooks run end to end (nbclient, CPU) and say what they should."""
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # left out of the quick run (README: -m "not slow")

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _run(name: str):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    texts, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", ""))
            data = out.get("data", {})
            texts.append(data.get("text/plain", ""))
            texts.append(data.get("text/html", ""))
            images += "image/png" in data
    return "\n".join(texts), images


def test_quickstart():
    text, _ = _run("01_quickstart.ipynb")
    assert "step 2: loss" in text
    assert text.count("opsmath::attention(") >= 2 and "dropout_add_norm" in text
    assert "torch.ops.opsmath.attention.default" in text
    assert "<pre" in text and "opsmath::attention(" in text.split("<pre", 1)[1]   # the HTML rendering


def test_explore_rewrites():
    text, images = _run("02_explore_rewrites.ipynb")
    assert "skipped by the user" in text
    assert "PASS" in text and "FAIL" not in text
    assert images >= 3   # the candidate's subgraph, the loss curves, the profile bars


def test_activation_memory():
    text, images = _run("03_activation_memory.ipynb")
    assert "prediction equals measurement: True" in text
    assert "monotone: True" in text and "segments planned" in text
    assert images >= 3 and "timeline peak within prediction: True" in text
