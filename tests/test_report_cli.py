"""The report's renderings and the CLI's main job."""
import importlib
import json
import re
import subprocess
import sys

import pytest
import torch

import opsmath
from opsmath.ui import cli
from opsmath import examples


def _optimized_gpt():
    torch.manual_seed(0)
    model, batch = examples.gpt(batch_size=2, seq_len=16)
    opt = opsmath.optimize(model)
    opt(*batch).backward()
    return opt


def test_report_fields_and_80_columns():
    rep = opsmath.report(_optimized_gpt())
    assert {m.pattern for m in rep.matches} == {"attention", "dropout_add_norm", "linear_cross_entropy", "bias_gelu"}
    for m in rep.matches:
        assert m.location.startswith("examples.py:") and m.nodes and m.before
    text = rep.render(width=80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "\x1b[" not in text  # plain text when not a terminal
    assert "opsmath::attention" in text and "examples.py:" in text
    g = rep.graphs[0]
    assert "opsmath.attention" in g.after_code and "opsmath.attention" not in g.before_code
    assert 0 < g.saved_bytes[1] < g.saved_bytes[0]     # measured on fake tensors, never silently zero
    # graph inputs carry their source names (the tied LM head reads the embedding's weight)
    lines = [line for m in rep.matches for line in m.before]
    assert any("h_0_ln_2_weight" in line for line in lines) and any("wte_weight" in line for line in lines)
    assert not any(re.search(r"\barg\d+_\d+\b", line) for line in lines), lines


def test_json_round_trip():
    rep = opsmath.report(_optimized_gpt())
    data = json.loads(rep.to_json())
    assert data == json.loads(json.dumps(rep.to_dict()))
    patterns = [m["pattern"] for g in data["graphs"] for m in g["matches"]]
    assert patterns.count("attention") == 2


def test_html_contains_every_match():
    rep = opsmath.report(_optimized_gpt())
    html = rep._repr_html_()
    assert html.count("opsmath::attention(") >= 2 and html.count("opsmath::dropout_add_norm(") >= 4


def test_report_before_first_call():
    model, _ = examples.gpt()
    rep = opsmath.report(opsmath.optimize(model))
    assert rep.matches == [] and "call the optimized model once" in rep.render()


def test_report_of_plain_module_is_an_error():
    import pytest
    with pytest.raises(ValueError, match="opsmath.optimize"):
        opsmath.report(torch.nn.Linear(2, 2))


def test_cli_example(capsys):
    assert cli.main(["report", "--example", "gpt", "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert "opsmath::attention" in out and "one training step on CPU" in out


def test_cpu_report_names_what_a_gpu_run_leaves_to_inductor(capsys):
    """On CPU the graph runs op by op with every family; the report must say which of those rewrites a
    CUDA run (Inductor on) would leave to Inductor, and must not say it when Inductor was chosen."""
    assert cli.main(["report", "--example", "gpt", "--width", "120"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "left to Inductor" in ln)
    assert "dropout_add_norm" in line and "attention" not in line
    model, batch = examples.gpt(batch_size=2, seq_len=16, n_layer=1)
    opt = opsmath.optimize(model, inductor=False)
    opt(*batch)
    assert all(not g.left_on_gpu for g in opsmath.report(opt).graphs)


def test_a_rewrite_that_keeps_more_for_backward_says_why(capsys):
    """DiT's short sequences: opsmath's attention keeps q, k, v, its output and row statistics, more
    than eager's small S x S probabilities; the report must name the family and what it keeps."""
    assert cli.main(["report", "--example", "dit", "--width", "120"]) == 0
    out = capsys.readouterr().out
    g = re.search(r"saved for bwd (\S+)->(\S+)", out)
    assert g is not None
    line = next(ln for ln in out.splitlines() if "saved for bwd grows" in ln)
    assert "attention" in line and "keeps q, k, v" in line


def test_a_norm_inside_a_module_is_located_at_its_call_site():
    """RMSNorm.forward is one line for every norm; the location adds where each is called, so a layer's
    attention norm and MLP norm are told apart."""
    model, batch = examples.llama(batch_size=2, seq_len=16)
    opt = opsmath.optimize(model)
    opt(*batch).backward()
    locs = {m.location for m in opsmath.report(opt).matches if m.pattern == "dropout_add_norm"}
    assert len(locs) >= 2 and all(re.fullmatch(r"examples\.py:\d+ via :\d+", loc) for loc in locs), locs


def test_cli_file_factory(tmp_path):
    f = tmp_path / "mymodel.py"
    f.write_text(
        "import torch\nfrom opsmath.examples import llama\n"
        "def build():\n    return llama(batch_size=2, seq_len=16)\n")
    res = subprocess.run([sys.executable, "-m", "opsmath.ui.cli", "report", f"{f}:build", "--json"],
                         capture_output=True, text=True, check=True)
    data = json.loads(res.stdout)
    assert sum(m["pattern"] == "attention" for g in data["graphs"] for m in g["matches"]) == 2


def test_cli_tune_needs_a_gpu_and_says_so():
    import pytest
    import torch
    from opsmath.ui.cli import main
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tuning would run")
    with pytest.raises(SystemExit, match="CUDA GPU"):
        main(["tune", "--example", "gpt"])
    with pytest.raises(SystemExit):
        main(["tune"])   # neither a file nor an example: a usage error


def test_cli_memory_budget_shows_the_plan_and_rejects_bad_budgets(capsys):
    assert cli.main(["report", "--example", "gpt", "--width", "100", "--memory-budget", "0.6"]) == 0
    out = capsys.readouterr().out
    assert "memory plan: budget 0.6" in out and "segments planned" in out
    for bad, says in (("lots", "cannot read memory_budget"), ("0.01", "smallest feasible")):
        with pytest.raises(SystemExit, match=says):
            cli.main(["report", "--example", "gpt", "--memory-budget", bad])


def test_cli_plots_the_memory_plan(tmp_path, capsys):
    """``--plot FILE`` saves the plan's predicted memory over the step; the chart's step line has one
    point per timeline entry and the budget line sits at the budget in bytes."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    assert cli.main(["report", "--example", "gpt", "--memory-budget", "0.6", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "memory plan chart" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="add --memory-budget"):
        cli.main(["report", "--example", "gpt", "--plot", str(tmp_path / "none.png")])


def test_plan_plot_draws_the_timeline_and_the_budget():
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    model, batch = examples.gpt(batch_size=2, seq_len=32)
    opt = opsmath.optimize(model, memory_budget=0.6)
    opt(*batch).backward()
    plan = opsmath.report(opt).graphs[0].plan
    ax = plan.plot()
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == "predicted"]
    assert len(line.get_xdata()) == len(plan.timeline())
    budget = [ln for ln in ax.get_lines() if ln.get_label() == "budget"][0]
    assert abs(budget.get_ydata()[0] - plan.budget_both_units()[0] / 2**20) < 1e-9


@pytest.mark.parametrize("kwargs,message", [
    (dict(skip=["atention"]), "unknown pattern families ['atention']"),
    (dict(skip=["atention@softmax_3"]), "unknown pattern families ['atention']"),
    (dict(patterns="atention"), "unknown pattern families ['atention']"),
    (dict(patterns=["attention", "swigloo"]), "unknown pattern families ['swigloo']"),
])
def test_unknown_pattern_names_are_an_error_naming_the_known_ones(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        opsmath.optimize(torch.nn.Linear(2, 2), **kwargs)
    assert "attention" in str(e.value).split("known:")[1]


def test_one_string_is_one_pattern_name():
    model = opsmath.optimize(torch.nn.Linear(2, 2), patterns="attention", skip="attention@softmax")
    assert [p.name for p in model._opsmath.patterns] == ["attention"] and model._opsmath.skip == {"attention@softmax"}
    with pytest.raises(TypeError, match="patterns= takes a name or a list of names, got int"):
        opsmath.optimize(torch.nn.Linear(2, 2), patterns=3)


def test_cli_version_and_bare_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"opsmath {opsmath.__version__} (torch ")
    assert cli.main([]) == 0 and "usage: opsmath" in capsys.readouterr().out


def test_import_opsmath_provides_optim():
    code = "import opsmath; print(opsmath.optim.AdamW.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "AdamW", out.stderr[-2000:]
    assert importlib.import_module("opsmath").optim is sys.modules["opsmath.optim"]


def test_a_wrong_input_after_capture_raises_what_eager_raises():
    """A shape mistake is reported as eager reports it (one line), not as a tracing failure."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.ReLU())
    opt = opsmath.optimize(model)
    opt(torch.randn(16, 32)).sum().backward()
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(16x31 and 32x96\)") as e:
        opt(torch.randn(16, 31))
    assert not isinstance(e.value, torch._dynamo.exc.TorchRuntimeError)
    assert opsmath.report(opt).fallback_errors   # and the report says the call was not traced


@pytest.mark.parametrize("width", [60, 80, 120])
def test_identical_rewrites_grouped_and_no_token_split(width):
    """Layers that repeat a rewrite show as one line with a count; wrapping never cuts a name, a number
    or a number from its unit."""
    rep = opsmath.report(_optimized_gpt())
    text = rep.render(width=width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert re.search(r"attention x2  examples\.py:\d+", text) and "bias_gelu x2" in text
    words = text.replace("│", " ").split()
    for token in ("opsmath::attention(scale=0.25,", "causal,", "eps=1e-05,", "opsmath::bias_gelu(256"):
        assert token in words, (token, text)
    assert re.search(r"\d(\.\d)?[KM]iB->\d+(\.\d)?[KM]iB", text), text
