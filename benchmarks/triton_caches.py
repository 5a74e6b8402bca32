"""Kernels a Triton cache directory holds more than once: the same kernel compiled under two cache keys
(opsmath's tuning launch and Inductor's copy of it in a graph's module, say), and what differs between
the entries: the compile options in each entry's metadata, and the TTIR's function signature (argument
attributes such as ``tt.divisibility``, the specialized constants folded into the body).

    python -m benchmarks triton_caches [DIR] [--match attention]

``first_step`` runs ``summarize`` on the cold Triton cache of each opsmath child: a kernel there twice is
a compile its first step paid twice.
"""
from __future__ import annotations

import argparse
import json
import os
import re

# metadata that says where or when, not how a kernel was compiled
_NOT_OPTIONS = {"hash", "triton_version", "name", "shared", "tmem_size", "global_scratch_size",
                "global_scratch_align", "profile_scratch_size", "profile_scratch_align"}


# Inductor's generated kernels (``triton_poi_fused_...``) are compiled once per candidate configuration by design
GENERATED = ("triton_poi_", "triton_per_", "triton_red_", "triton_tem_")


def entries(root: str, match: str = "") -> dict[str, list[dict]]:
    """Kernel name -> its entries in the cache ``root``: ``hash`` (the entry's directory), ``options``
    (the metadata's compile options) and ``signature`` (the TTIR's ``tt.func`` line, or ""). Inductor's
    generated kernels are left out (``GENERATED``)."""
    found: dict[str, list[dict]] = {}
    if not os.path.isdir(root):
        return found
    for key in sorted(os.listdir(root)):
        folder = os.path.join(root, key)
        if not os.path.isdir(folder):
            continue
        for f in os.listdir(folder):
            if not f.endswith(".json") or f.startswith("__grp__"):
                continue
            name = f[:-5]
            if name.startswith(GENERATED) or (match and match not in name):
                continue
            try:
                with open(os.path.join(folder, f)) as fh:
                    meta = json.load(fh)
            except (OSError, ValueError):
                continue
            found.setdefault(name, []).append(dict(hash=key, options={k: v for k, v in meta.items()
                                                                      if k not in _NOT_OPTIONS},
                                                   signature=_signature(os.path.join(folder, name + ".ttir"))))
    return found


def _signature(path: str) -> str:
    try:
        with open(path) as fh:
            for line in fh:
                if "tt.func" in line:
                    return re.sub(r"loc\(#loc\d*\)", "", line.strip())
    except OSError:
        pass
    return ""


def differences(a: dict, b: dict) -> list[str]:
    """What differs between two entries of one kernel: options by key, then the signature's arguments."""
    out = [f"option {k}: {a['options'].get(k)!r} vs {b['options'].get(k)!r}"
           for k in sorted(set(a["options"]) | set(b["options"])) if a["options"].get(k) != b["options"].get(k)]
    if a["signature"] != b["signature"]:
        sa, sb = re.split(r",\s*(?=%)", a["signature"]), re.split(r",\s*(?=%)", b["signature"])
        out += [f"argument {i}: {x} vs {y}" for i, (x, y) in enumerate(zip(sa, sb)) if x != y]
        if len(sa) != len(sb):
            out.append(f"arguments: {len(sa)} vs {len(sb)}")
    return out or ["nothing in the options or the signature (the source or a global differs)"]


def summarize(root: str, match: str = "") -> dict:
    """``{entries, kernels, twice: {name: [differences of each later entry from the first]}}``."""
    found = entries(root, match)
    twice = {name: [differences(es[0], e) for e in es[1:]] for name, es in found.items() if len(es) > 1}
    return dict(entries=sum(map(len, found.values())), kernels=len(found), twice=twice)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", default=os.environ.get("TRITON_CACHE_DIR",
                                                             os.path.expanduser("~/.triton/cache")))
    ap.add_argument("--match", default="")
    args = ap.parse_args(argv)
    s = summarize(args.root, args.match)
    print(f"{args.root}: {s['entries']} entries of {s['kernels']} kernels; {len(s['twice'])} kernels more than once")
    for name, diffs in s["twice"].items():
        for d in diffs:
            print(f"  {name}: " + "; ".join(d[:6]))


if __name__ == "__main__":
    main()
