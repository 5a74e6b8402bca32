"""``python -m benchmarks fleet`` runs end to end at toy size on CPU (``--smoke``): every model and recipe
asked for gets its rows in the JSON, none an error row. It measures nothing in this mode."""
import glob
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow   # about 40 s on two cores (README: -m "not slow" leaves it out)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODELS = ["gpt2", "bert", "mixtral"]   # a decoder with a graph break, a padded encoder, experts


def test_fleet_smoke_rows_for_both_recipes(tmp_path, capsys):
    env = dict(os.environ, OUT=str(tmp_path), OPSMATH_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "benchmarks", "fleet", "--smoke", "--models", ",".join(MODELS)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    (path,) = glob.glob(str(tmp_path / "fleet-*-smoke-*.json"))
    out = json.load(open(path))
    assert not [row for row in out["rows"] if "error" in row], out["rows"]
    got = {(row["model"], row["recipe"], row["variant"]) for row in out["rows"]}
    assert got == {(m, recipe, v) for m in MODELS for recipe in ("amp", "bf16") for v in ("eager", "opsmath.optimize")}
    for row in out["rows"]:
        assert row["ms"] > 0 and row["first_step_s"] > 0 and 0 < row["first_loss"] < 20, row
        assert row["baseline"] == "eager" and row["params"] > 0, row
        if row["variant"] == "opsmath.optimize":
            assert row["rewrites"] and row["graphs"] >= 1 and row["declines"] >= 0 and row["fallbacks"] == [], row
    assert set(out["summary"]["recipes"]) == {"amp opsmath.optimize", "bf16 opsmath.optimize"}
    sys.path.insert(0, ROOT)   # --table: the same rows as BENCHMARKS.md's table, one per recipe, and the summary
    from benchmarks.fleet import table
    table([path])
    printed = capsys.readouterr().out
    for row in out["rows"]:
        if row["variant"] == "opsmath.optimize":
            assert f"| {row['model']} ({row['shape']}) | " in printed and f"{1 / row['ms_ratio']:.3f}x" in printed, row
    assert printed.count("**amp**") == printed.count("**bf16**") == 1 and "geometric mean over 3 models" in printed


def test_width_doubles_widths_and_head_counts_not_head_sizes():
    """``--width 2``: every model's widths and head counts twice, its depth, head size and vocabulary kept."""
    sys.path.insert(0, ROOT)
    from benchmarks.fleet import MODELS as FLEET, config
    for name in FLEET:
        one, two = config(name, False), config(name, False, 2)
        widened = {k for k in one if two[k] != one[k]}
        assert widened and all(two[k] == 2 * one[k] for k in widened), name
        assert not widened & {"head_dim", "d_kv", "num_hidden_layers", "n_layer", "num_layers", "vocab_size"}, name
        heads = [k for k in ("num_attention_heads", "n_head", "num_heads") if k in one]
        size = one.get("hidden_size", one.get("n_embd", one.get("d_model")))
        if heads and "head_dim" not in one and "d_kv" not in one:   # head size implied: width / heads, kept
            assert size // one[heads[0]] == 2 * size // two[heads[0]], name
