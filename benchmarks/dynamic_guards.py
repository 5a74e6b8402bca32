"""Why a model recompiles for every sequence length: the stack where a symbolic size is pinned to a value.

Under dynamic shapes, any ``int()`` of a symbolic size (often inside fake-tensor dispatch) makes
dynamo's shape env replace the size's symbol by its current value, so the next length recompiles. This
script wraps ``ShapeEnv._set_replacement``, prints the user-relevant stack of each symbol pinned to an
integer, and runs a tiny Hugging Face LLaMA (default SDPA attention) under ``opsmath.optimize`` at three
lengths; its last line lists each graph as (dynamic, calls, rewrites): one dynamic graph serving two
calls is the healthy outcome.

    python benchmarks/dynamic_guards.py [--device cuda] [--inductor 0|1]
"""
from __future__ import annotations

import argparse
import sys
import traceback

import sympy
import torch
import torch.fx.experimental.symbolic_shapes as symbolic_shapes

import opsmath

_QUIET = ("/sympy/", "symbolic_convert", "eval_frame")


def _fx_node_running() -> str:
    """The graph node an ``fx.Interpreter`` up the stack is running, if any (names the guarding op)."""
    frame = sys._getframe(1)
    while frame is not None:
        n = frame.f_locals.get("n")
        if isinstance(n, torch.fx.Node):
            return f"while running node {n.format_node()} {n.meta.get('val', '')!r:.120}"
        frame = frame.f_back
    return ""


def spy_on_replacements() -> None:
    original = symbolic_shapes.ShapeEnv._set_replacement
    seen = set()

    def spy(self, a, tgt, msg):
        if isinstance(tgt, sympy.Integer) and (str(a), int(tgt)) not in seen:
            seen.add((str(a), int(tgt)))
            stack = [f for f in traceback.format_stack() if not any(q in f for q in _QUIET)][-28:]
            print(f"pinned: {a} -> {tgt} ({msg}) {_fx_node_running()}\n" + "".join(stack), flush=True)
        return original(self, a, tgt, msg)
    symbolic_shapes.ShapeEnv._set_replacement = spy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--inductor", type=int, default=None)
    args = ap.parse_args()
    import transformers
    spy_on_replacements()
    torch._logging.set_logs(recompiles=True)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=256)
    inductor = None if args.inductor is None else bool(args.inductor)
    model = opsmath.optimize(transformers.LlamaForCausalLM(cfg).to(args.device), inductor=inductor)
    for T in (16, 24, 40):
        ids = torch.randint(0, 256, (2, T), device=args.device)
        model(input_ids=ids, labels=ids).loss.backward()
    rep = opsmath.report(model)
    print("graphs (dynamic, calls, rewrites):", [(g.dynamic, g.calls, len(g.matches)) for g in rep.graphs],
          "unoptimized calls:", rep.unoptimized_calls, flush=True)


if __name__ == "__main__":
    main()
