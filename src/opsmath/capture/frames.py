"""Where captured code came from: the user's frames of a node's stack trace (outside torch and opsmath's
machinery; the bundled examples count as user code), as the report and error notes name them."""
from __future__ import annotations

import os

import torch
import torch.fx as fx


def source_location(node: fx.Node) -> tuple[str, str]:
    """(``file.py:123``, the source line) of the user code that produced ``node``, from its stack trace.
    Where that line is inside a module called from user code (a norm's ``forward``), the call site
    follows: ``modeling_llama.py:67 via :301``, which tells one norm of a layer from the other."""
    frames = user_frames(node.meta.get("stack_trace") or "")
    if not frames:
        return "<unknown>", ""
    path, lineno, code = frames[-1]
    loc = f"{os.path.basename(path)}:{lineno}"
    if len(frames) > 1:
        cpath, clineno, _ = frames[-2]
        loc += f" via :{clineno}" if cpath == path else f" via {os.path.basename(cpath)}:{clineno}"
    return loc, code


_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_EXAMPLES = os.path.join(PACKAGE, "examples.py")


def internal(path: str) -> bool:
    """A frame of torch or of opsmath's own machinery (the bundled examples are user code)."""
    path = os.path.abspath(path)
    return path.startswith(_TORCH) or (path.startswith(PACKAGE) and path != _EXAMPLES)


def user_frames(trace: str) -> list[tuple[str, str, str]]:
    """(path, line number, code) of each frame of a stack trace outside opsmath and torch."""
    lines = trace.strip().splitlines()
    frames = []
    for i, ln in enumerate(lines):
        s = ln.strip()
        if not s.startswith('File "'):
            continue
        try:
            path, lineno = s.split('"')[1], s.split("line ")[1].split(",")[0]
        except IndexError:
            continue
        if not internal(path):
            frames.append((path, lineno, lines[i + 1].strip() if i + 1 < len(lines) else ""))
    return frames


def note_source(exc: BaseException) -> None:
    """Name the user's line in an error raised inside a captured graph run op by op. Its traceback ends in
    fx's generated code (``<eval_with_key>``), not in the user's file; the generated line gives the node
    (fx's line map), the node's stack trace the user's line, added to the error as a note (Python 3.11+)."""
    tb = exc.__traceback__
    while tb is not None and hasattr(exc, "add_note"):
        code = tb.tb_frame.f_code
        gm = tb.tb_frame.f_locals.get("self")
        if code.co_filename.startswith("<eval_with_key>") and isinstance(gm, fx.GraphModule):
            index = (getattr(gm, "_lineno_map", None) or {}).get(tb.tb_lineno - code.co_firstlineno)
            nodes = list(gm.graph.nodes)
            if index is not None and index < len(nodes):
                loc, line = source_location(nodes[index])
                if loc != "<unknown>":
                    exc.add_note(f"opsmath: raised by the captured graph's {nodes[index].target} from {loc}: {line}")
            return
        tb = tb.tb_next
