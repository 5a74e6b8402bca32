"""``opsmath`` command line.

    opsmath report --example gpt             # bundled nanoGPT: optimize, one training step, report
    opsmath report path/to/file.py:factory   # your model: factory() -> (model, batch) or model
    opsmath report ... --json                # the report as JSON
    opsmath report ... --memory-budget 0.75  # with a recompute plan ("6GiB", bytes, or a fraction)
    opsmath tune path/to/file.py:factory     # on a GPU: pre-tune every rewritten op for the model's shapes

A factory returns ``(model, batch)`` with ``model(*batch)`` returning the loss (or a tensor whose sum
is used as one), or just a model, in which case ``--input-shape`` gives a random float input.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

from opsmath.examples import EXAMPLES

_DESCRIPTION = "\n\n".join(part.replace("``", "") for part in __doc__.split("\n\n")[:2])


def _load_factory(spec: str):
    if ":" not in spec:
        raise SystemExit(f"expected <file.py>:<factory>, got {spec!r}")
    path, name = spec.rsplit(":", 1)
    file = Path(path)
    if not file.exists():
        raise SystemExit(f"no such file: {file}")
    sys.path.insert(0, str(file.parent.resolve()))
    mod_spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise SystemExit(f"{file} has no attribute {name!r}")
    return getattr(module, name)


def _build(args):
    if args.example:
        return EXAMPLES[args.example]()
    made = _load_factory(args.target)()
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        model, batch = made
        return model, tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    if isinstance(made, torch.nn.Module):
        if not args.input_shape:
            raise SystemExit("the factory returned only a model: pass --input-shape, e.g. 2,3,224,224")
        return made, (torch.randn(*[int(s) for s in args.input_shape.split(",")]),)
    raise SystemExit("the factory must return a model or (model, batch)")


def _report(args) -> int:
    import opsmath

    torch.manual_seed(args.seed)
    model, batch = _build(args)
    model.train()
    from opsmath.memory.plan import InfeasibleBudget
    try:
        opt = opsmath.optimize(model, memory_budget=args.memory_budget)
        out = opt(*batch)
    except (InfeasibleBudget, ValueError) as e:
        if args.memory_budget is None or not ("memory_budget" in str(e) or isinstance(e, InfeasibleBudget)):
            raise
        raise SystemExit(f"opsmath report: {e}") from None
    loss = out if out.dim() == 0 else out.float().sum()
    loss.backward()
    rep = opsmath.report(opt)
    if args.plot:
        _plot_plans(rep, args.plot)
    if args.json:
        print(rep.to_json(indent=2))
    else:
        from rich.console import Console
        Console(width=args.width).print(rep)
        print(f"one training step on CPU: loss {loss.item():.4f}")
    return 0


def _plot_plans(rep, path: str) -> None:
    """The memory plan of every planned graph, one chart each, saved to ``path`` (format by extension)."""
    plans = [g.plan for g in rep.graphs if g.plan is not None]
    if not plans:
        raise SystemExit("opsmath report --plot: no memory plan to draw (add --memory-budget)")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(plans), 1, figsize=(7, 3.2 * len(plans)), squeeze=False)
    for plan, ax in zip(plans, axes[:, 0]):
        plan.plot(ax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"memory plan chart: {path}")


def _tune(args) -> int:
    import opsmath
    from opsmath.kernels import autotune

    if not torch.cuda.is_available():
        raise SystemExit("opsmath tune measures kernels on a CUDA GPU; none is available")
    torch.manual_seed(args.seed)
    model, batch = _build(args)
    model = model.cuda().train()
    batch = tuple(b.cuda() if isinstance(b, torch.Tensor) else b for b in batch)
    before = autotune.load().get(autotune.machine_key(), {})
    opt = opsmath.optimize(model)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[args.dtype]
    with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
        out = opt(*batch)
    (out if out.dim() == 0 else out.float().sum()).backward()
    after = autotune.load().get(autotune.machine_key(), {})
    print(f"tuning cache: {autotune.cache_path()}  ({autotune.machine_key()})")
    for op, entries in after.items():
        for key, e in entries.items():
            new = key not in before.get(op, {})
            ms = ", ".join(f"{k} {v:.3f}" for k, v in sorted(e.get("ms", {}).items(), key=lambda kv: kv[1]))
            print(f"{'new ' if new else '    '}{op} [{key}] -> {e['choice']}   ms: {ms}")
    for m in opsmath.report(opt).graphs[-1].matches:
        print(f"  {m.location}: {m.replacement}")
    return 0


def main(argv=None) -> int:
    from opsmath import __version__
    parser = argparse.ArgumentParser(prog="opsmath", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"opsmath {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="cmd")
    rp = sub.add_parser("report", help="optimize a model, run one training step on CPU, print the graph diff")
    rp.add_argument("target", nargs="?", help="<file.py>:<factory>")
    rp.add_argument("--example", choices=sorted(EXAMPLES), help="a bundled example")
    rp.add_argument("--input-shape", help="random input shape when the factory returns only a model")
    rp.add_argument("--json", action="store_true", help="print the report as JSON")
    rp.add_argument("--width", type=int, default=None, help="terminal width (default: auto)")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--memory-budget", help="plan recompute under this budget and show the plan: a fraction "
                                            "of the activations (0.5), bytes, or a size (6GiB)")
    rp.add_argument("--plot", metavar="FILE", help="with --memory-budget: save the plan's predicted memory over "
                                                   "the step as a chart (.png, .svg, .pdf)")
    tp = sub.add_parser("tune", help="on a GPU: optimize a model, tune its rewritten ops, fill the cache")
    tp.add_argument("target", nargs="?", help="<file.py>:<factory>")
    tp.add_argument("--example", choices=sorted(EXAMPLES), help="a bundled example")
    tp.add_argument("--input-shape", help="random input shape when the factory returns only a model")
    tp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="autocast dtype")
    tp.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cmd is None:   # bare ``opsmath``: what it can do
        parser.print_help()
        return 0
    if args.cmd == "tune":
        if bool(args.target) == bool(args.example):
            parser.error("give either <file.py>:<factory> or --example NAME")
        return _tune(args)
    if args.cmd == "report":
        if bool(args.target) == bool(args.example):
            parser.error("give either <file.py>:<factory> or --example NAME")
        return _report(args)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
