"""opsmath's source is part of Inductor's compile cache key (``runtime/cache_key``): the same graph compiled
again is served from the cache, and served nothing once opsmath's source differs."""
import uuid

import torch
from torch._dynamo.utils import counters

import opsmath
from opsmath.runtime import cache_key


def _compile_once():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8))
    before = {k: dict(v) for k, v in counters.items()}
    opsmath.optimize(model, inductor=True)(torch.randn(6, 24, requires_grad=True)).sum().backward()
    delta = lambda group, key: counters[group].get(key, 0) - before.get(group, {}).get(key, 0)  # noqa: E731
    return dict(hits=delta("inductor", "fxgraph_cache_hit") + delta("aot_autograd", "autograd_cache_hit"),
                misses=delta("inductor", "fxgraph_cache_miss"))


def test_a_recompiled_graph_hits_the_cache_until_opsmaths_source_changes(monkeypatch):
    assert cache_key.patches(), "torch has keyed custom passes from 2.5 on"
    _compile_once()
    again = _compile_once()
    assert again["hits"] >= 1 and again["misses"] == 0, again
    upgraded = f"an upgraded opsmath {uuid.uuid4()}"   # never compiled before (the cache is on disk)
    monkeypatch.setattr(cache_key, "source_hash", lambda: upgraded)
    changed = _compile_once()
    assert changed["hits"] == 0 and changed["misses"] >= 1, changed


def test_a_users_own_post_grad_pass_is_kept():
    # (config.patch, not monkeypatch: monkeypatch's undo deletes the key, hiding it from later tests)
    with torch._inductor.config.patch(post_grad_custom_pre_pass=cache_key.SourceKey()):
        assert cache_key.patches() == {}
    assert cache_key.patches()


def test_joint_passes_are_keyed_only_where_every_pass_is():
    from opsmath.runtime import wgrad
    seen = []
    keyed = wgrad.joint_pass(frozenset({0}))
    unkeyed = seen.append
    both = cache_key.JointPasses([None, keyed])
    assert both.uuid() and "fp32-wgrad [0]" in both.uuid()
    assert cache_key.JointPasses([keyed, unkeyed]).uuid() is None
    graph = torch.fx.Graph()
    graph.output(())
    cache_key.JointPasses([unkeyed, None])(graph)
    assert seen == [graph]
