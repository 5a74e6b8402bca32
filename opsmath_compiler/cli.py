"""``opsmath`` command line.

    opsmath report --example gpt             # bundled nanoGPT: optimize, one training step, report
    opsmath report path/to/file.py:factory   # your model: factory() -> (model, batch) or model
    opsmath report ... --json                # the report as JSON

A factory returns ``(model, batch)`` with ``model(*batch)`` returning the loss (or a tensor whose sum
is used as one), or just a model, in which case ``--input-shape`` gives a random float input.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch


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
        from .examples import EXAMPLES
        if args.example not in EXAMPLES:
            raise SystemExit(f"unknown example {args.example!r}; choose from {sorted(EXAMPLES)}")
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
    opt = opsmath.optimize(model)
    out = opt(*batch)
    loss = out if out.dim() == 0 else out.float().sum()
    loss.backward()
    rep = opsmath.report(opt)
    if args.json:
        print(rep.to_json(indent=2))
    else:
        from rich.console import Console
        Console(width=args.width).print(rep)
        print(f"one training step on CPU: loss {loss.item():.4f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="opsmath", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("report", help="optimize a model, run one training step on CPU, print the graph diff")
    rp.add_argument("target", nargs="?", help="<file.py>:<factory>")
    rp.add_argument("--example", help="a bundled example: gpt or llama")
    rp.add_argument("--input-shape", help="random input shape when the factory returns only a model")
    rp.add_argument("--json", action="store_true", help="print the report as JSON")
    rp.add_argument("--width", type=int, default=None, help="terminal width (default: auto)")
    rp.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cmd == "report":
        if bool(args.target) == bool(args.example):
            parser.error("give either <file.py>:<factory> or --example NAME")
        return _report(args)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
