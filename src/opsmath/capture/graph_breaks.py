"""Dynamo's graph breaks in an optimized model's frames, with the user's line each one happened at.

The code around a graph break runs as plain Python, unrewritten: the report lists each break (an
``EagerRegion`` of kind "graph break"). Dynamo counts breaks by reason (``counters["graph_break"]``),
without a place; the place is in its ``graph_breaks`` log artifact, which it formats only when that log is
on. ``watch()`` turns it on for a handler of opsmath's own, not propagated: nothing reaches the user's
output unless they asked for the artifact themselves (``TORCH_LOGS=graph_breaks``), and then they keep
it. Each record gives the innermost frame dynamo stopped at (``torch/nn/modules/transformer.py:1245``) and
the user's stack; the report names the innermost frame outside torch and opsmath
(``model.py:189``), and the torch frame where the break is inside torch.
"""
from __future__ import annotations

import logging
import os
import re

import torch
from torch.torch_version import Version

from opsmath.capture.frames import PACKAGE, internal

_SITES: list[tuple[int, str, str, str, str]] = []   # (number, log text, user location, user code, torch frame)
_MAX_SITES = 256
_RECORDED = [0]   # sites recorded so far in this process
_WATCHED = ("torch._dynamo.symbolic_convert", "torch._dynamo.convert_frame")
_AT = re.compile(r"in user code at (.+?):(\d+)")
_FRAME = re.compile(r'File "(.+?)", line (\d+), in .*\n(.*)')


class _Sites(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:   # a record this handler cannot format tells it nothing
            return
        at = _AT.search(text)
        if at is None or "User code traceback:" not in text:   # a duplicate's record carries no stack
            return
        inner = f"{at.group(1)}:{at.group(2)}"
        frames = _FRAME.findall(text.split("User code traceback:", 1)[1])
        # the model's frames: after opsmath's own call of the model (before it, the training loop's)
        ours = [i for i, (path, _, _) in enumerate(frames) if os.path.abspath(path).startswith(PACKAGE)
                and internal(path)]   # (the bundled examples are model code)
        mine = [f for f in frames[ours[-1] + 1 if ours else 0:] if not internal(f[0])]
        if mine:
            path, lineno, code = mine[-1]
            loc = f"{os.path.basename(path)}:{lineno}"
        else:   # inside torch's own modules (nn.Transformer): the torch line
            loc, code = _short(inner), next((c for p, n, c in reversed(frames) if f"{p}:{n}" == inner), "")
        del _SITES[:-_MAX_SITES]
        _RECORDED[0] += 1
        _SITES.append((_RECORDED[0], text, loc, code.strip(), _short(inner) if internal(at.group(1)) and mine else ""))


_HANDLER = _Sites()


def _short(path_line: str) -> str:
    """``.../site-packages/torch/nn/modules/transformer.py:1245`` -> ``torch/nn/modules/transformer.py:1245``."""
    i = path_line.rfind(os.sep + "torch" + os.sep)
    return path_line[i + 1:] if i >= 0 else os.path.basename(path_line)


def watch() -> None:
    """Record graph-break sites from now on (idempotent)."""
    try:
        import torch._logging as tl
        for module in _WATCHED:
            log = tl.getArtifactLogger(module, "graph_breaks")
            if _HANDLER in log.handlers:
                continue
            if not log.isEnabledFor(logging.DEBUG):   # not the user's: on for this handler alone
                log.setLevel(logging.DEBUG)
                log.propagate = False
            log.addHandler(_HANDLER)
    except Exception:   # a torch without the artifact: breaks are still listed, without a place
        return


def counts() -> tuple[dict, int]:
    """Dynamo's graph-break counts by reason so far in this process (its ``counters["graph_break"]``), and
    the number of break sites recorded: what ``note`` compares against."""
    from torch._dynamo.utils import counters
    return dict(counters["graph_break"]), _RECORDED[0]


def _sites(reason: str, after: int, claimed: set) -> list[tuple[str, str, str, str]]:
    """(user location, code, torch frame, skipped frame) of each break recorded after site ``after`` whose log
    names ``reason`` (one per location); their site numbers go into ``claimed``."""
    first = str(reason).strip().splitlines()[0] if str(reason).strip() else ""
    found = {}
    for number, text, loc, code, inner in _SITES:
        if number > after and first and first in text:
            claimed.add(number)
            found.setdefault(loc, (loc, code, inner, _skipped(text)))
    return list(found.values())


def _skipped(text: str) -> str:
    """`` (frame skipped: forward at model.py:481)`` where the record says dynamo skipped a whole frame (a
    break inside a loop), else ""."""
    m = re.search(r"frame skipped: (\S+) \((.+?) line (\d+)\)", text)
    return f" (frame skipped: {m.group(1)} at {os.path.basename(m.group(2))}:{m.group(3)})" if m else ""


def _logged_reason(text: str) -> str:
    """A break's reason as its log record gives it: what dynamo encountered ("graph break in loop", or the
    cause: "... Could not extract specialized integer from data-dependent expression u0"), else its "Graph
    Break Reason" line."""
    body = text.split("Graph Break Reason:", 1)[-1].split("User code traceback:", 1)[0]
    lines = [ln.strip() for ln in body.split("Graph break encountered:", 1)[-1].splitlines() if ln.strip()]
    if not lines:
        return "graph break"
    what = lines[0]
    if what.endswith(":") and len(lines) > 1:     # "... a variadic function call, e.g. f(*args):", the cause next
        what = lines[1]
    if what == "graph break in loop":
        return "graph break in loop: the whole frame runs as plain Python"
    return what[:300]


def _merged(whys: list, skipped: str) -> str:
    """One break's reasons from its several log records (the cause, a repeat of it, the loop's frame skip):
    the frame skip first with the frame it names, then each distinct cause."""
    loop = [w for w in whys if w.startswith("graph break in loop")]
    causes = []
    for w in whys:
        if w not in loop and not any(w[:60] in k or k[:60] in w for k in causes):
            causes.append(w)
    head = [loop[0] + skipped] if loop else []
    text = "; ".join(head + causes) + ("" if loop else skipped)
    return text[:300]


def note(before: tuple[dict, int], regions: list) -> None:
    """Append a region for each graph break since ``before`` (``counts()``) that ``regions`` does not list
    yet, at each of its recorded places: the code around a graph break runs as plain Python, unrewritten."""
    seen, recorded = before
    listed = {(r.location, r.reason) for r in regions if r.kind == "graph break"}
    claimed: set = set()
    for reason, n in counts()[0].items():
        if n <= seen.get(reason, 0):
            continue
        flat = " ".join(str(reason).split())
        text = flat.split(" Explanation:")[0][:200]
        why = re.search(r"\(reason: (.+?)\)(?: Hint:|$)", flat)     # a ``disable(..., reason=...)``'s own
        if why and why.group(1) != "None":
            text = f"{text}: {why.group(1)}"[:300]
        places = _sites(reason, recorded, claimed)
        if not places and any(t == text or t.startswith(text + " (in ") for _, t in listed):
            continue   # broken again where it broke before (dynamo logs a repeat without its stack)
        for loc, code, inner, skipped in places or [("", "", "", "")]:
            _add(regions, listed, loc, code, (f"{text} (in {inner})" if inner else text) + skipped)
    # Breaks dynamo logs but does not count by reason (``counters["graph_break"]``): a break in a loop makes it
    # skip the whole frame (its ``counters["unimplemented"]``), so that frame runs as plain Python. Its records
    # (the cause, a repeat, the skip) become one region per place.
    places: dict = {}
    for number, text, loc, code, inner in _SITES:
        if number > recorded and number not in claimed:
            place = places.setdefault(loc, dict(code=code, inner=inner, whys=[], skipped=""))
            place["whys"].append(_logged_reason(text))
            place["skipped"] = place["skipped"] or _skipped(text)
    for loc, p in places.items():
        why = _merged(p["whys"], p["skipped"])
        _add(regions, listed, loc, p["code"], f"{why} (in {p['inner']})" if p["inner"] else why)


def _add(regions: list, listed: set, loc: str, code: str, why: str) -> None:
    """Append a graph-break region at ``loc`` unless ``listed`` (the (location, reason) pairs so far) has it."""
    from opsmath.capture.regions import EagerRegion
    if (loc, why) not in listed:
        listed.add((loc, why))
        regions.append(EagerRegion("graph break", loc, code, why))


def reordered_logs() -> dict:
    """The dynamo setting under which a one-time log call in the model's code is no graph break: Hugging
    Face's ``logger.warning_once`` (installed on ``logging.Logger`` by transformers, called from many
    ``forward``s) runs after the graph instead of inside it, the same message printed once. Dynamo reorders
    ``logging.Logger`` methods from torch 2.14 on; before, the call stays a graph break (as under
    ``torch.compile``; ``hf_loss_resolved`` removes the most common one). Empty where it does not apply."""
    warning_once = getattr(logging.Logger, "warning_once", None)
    if warning_once is None or Version(torch.__version__).release[:2] < (2, 14):
        return {}
    current = torch._dynamo.config.reorderable_logging_functions
    return {"reorderable_logging_functions": current | {warning_once}}


def hf_loss_resolved(model) -> None:
    """Read Hugging Face's ``loss_function`` once before capture and keep it (its own setter). The property
    logs a warning on every access when the config names no known loss type (``GPT2LMHeadModel``: "loss_type
    =None ... Using the default loss"); traced, that log call was a graph break before the loss, so every
    enclosing frame was traced again up to it (four whole traces of the model instead of one) and the LM head
    and its loss fell into different graphs, never fused. The same function is used, and the message is
    printed now, once, instead of at the first forward."""
    for m in model.modules():
        prop = getattr(type(m), "loss_function", None)
        if isinstance(prop, property) and prop.fset is not None and "_loss_function" not in vars(m) \
                and type(m).__module__.startswith("transformers."):
            try:
                m.loss_function = m.loss_function
            except Exception:  # noqa: BLE001 (a model whose loss cannot be resolved yet keeps the property)
                pass
