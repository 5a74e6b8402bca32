"""Optimizer state that counts its own changes, so a fused optimizer's cached launch tables can be checked
against it at no per-parameter cost each step.

``torch.optim.Optimizer.state`` is a ``defaultdict(dict)`` of per-parameter entries, and it is the truth:
code replaces it (``opt.state = defaultdict(dict)``, ``load_state_dict``), clears it, deletes or replaces an
entry, or swaps a tensor inside one. ``TrackedState`` and its entries (``TrackedEntry``) are dicts that bump
one shared version on every such change; rebinding ``opt.state`` itself is seen by identity. Tensors changed
in place need no tracking: the tables point at them.

``plain(entry)`` is what a checkpoint holds: ``state_dict()`` returns plain dicts, so a checkpoint loads
with ``torch.load(weights_only=True)`` and into ``torch.optim.AdamW``.
"""
from __future__ import annotations

from collections import defaultdict


class _Version:
    __slots__ = ("value",)

    def __init__(self):
        self.value = 0


def _bumping(name: str):
    base = getattr(dict, name)

    def method(self, *args, **kwargs):
        self._version.value += 1
        return base(self, *args, **kwargs)
    method.__name__ = name
    return method


_MUTATORS = ("__setitem__", "__delitem__", "clear", "pop", "popitem", "update", "setdefault")


class TrackedEntry(dict):
    """One parameter's state; every change bumps the shared version."""
    __slots__ = ("_version",)

    def __init__(self, version: _Version, items=()):
        super().__init__(items)
        self._version = version

    def __reduce__(self):   # pickled (an optimizer saved whole) as a plain dict
        return dict, (dict(self),)


class TrackedState(defaultdict):
    """``Optimizer.state`` whose entries are ``TrackedEntry``; ``version`` counts every change."""

    def __init__(self, items=()):
        self._version = _Version()
        super().__init__(self._entry)
        for k, v in dict(items).items():
            dict.__setitem__(self, k, v if isinstance(v, TrackedEntry) and v._version is self._version
                             else TrackedEntry(self._version, v))

    def _entry(self) -> TrackedEntry:
        return TrackedEntry(self._version)

    @property
    def version(self) -> int:
        return self._version.value

    def __setitem__(self, key, value):
        self._version.value += 1
        if not (isinstance(value, TrackedEntry) and value._version is self._version):
            value = TrackedEntry(self._version, value)
        dict.__setitem__(self, key, value)

    def __reduce__(self):   # pickled as torch keeps it
        return defaultdict, (dict, {k: dict(v) for k, v in self.items()})


for _name in _MUTATORS:
    setattr(TrackedEntry, _name, _bumping(_name))
    if _name != "__setitem__":
        setattr(TrackedState, _name, _bumping(_name))


def tracked(state) -> TrackedState:
    """``state`` itself when it is a ``TrackedState``, else a tracked copy of its entries (the same tensors)."""
    return state if isinstance(state, TrackedState) else TrackedState(state)


def plain(entry: dict) -> dict:
    return dict(entry)
