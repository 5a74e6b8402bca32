"""opsmath's own source in Inductor's compile cache key.

Inductor's FX graph cache and AOTAutograd's cache key a compiled graph by its code, inputs and Inductor's
config, not by what a custom op in it does: after an upgrade that changes one of opsmath's ops (its outputs'
shapes under some arguments, a kernel's code traced into the graph), a warm cache would serve code compiled
for the old op (seen: a stale graph asserting the old shape of ``opsmath::linear_cross_entropy``'s dX). A
no-op post-grad pass whose ``uuid`` is the hash of opsmath's Python sources, which Inductor adds to both
keys, makes every such change a cache miss. It is set only where the user has no post-grad pre-pass of
their own (theirs is kept, and opsmath's changes then go unkeyed, as before).
"""
from __future__ import annotations

import functools
import hashlib
import pathlib

import torch

PACKAGE = pathlib.Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 of every ``.py`` file of the installed opsmath package, paths included."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:   # a torch without keyed custom passes: nothing to add
    CustomGraphPass = None

if CustomGraphPass is not None:
    class SourceKey(CustomGraphPass):
        """A post-grad pass that changes nothing; its ``uuid`` keys the compile caches by opsmath's source."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return "opsmath-" + source_hash()


class JointPasses(*([CustomGraphPass] if CustomGraphPass is not None else [])):
    """Joint-graph passes run in turn (``None`` entries skipped), as Inductor's ``joint_custom_post_pass``.
    Keyed (Inductor's and AOTAutograd's caches stay on) where every pass carries a ``cache_key`` attribute
    or a ``uuid``: opsmath's source hash and theirs; otherwise the caches are bypassed for the graph, as
    for any unkeyed custom pass."""

    def __init__(self, passes):
        self.passes = [p for p in passes if p is not None]
        keys = [getattr(p, "cache_key", None) or (p.uuid() if hasattr(p, "uuid") else None) for p in self.passes]
        self.key = "opsmath-joint-" + source_hash() + repr(keys) if keys and all(keys) else None

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self):
        return self.key


def patches() -> dict:
    """Inductor config patches that put opsmath's source in its cache keys ({} where the user set a
    post-grad pre-pass, or torch has no keyed passes)."""
    if CustomGraphPass is None or torch._inductor.config.post_grad_custom_pre_pass is not None:
        return {}
    return {"post_grad_custom_pre_pass": SourceKey()}
