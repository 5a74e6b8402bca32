"""A small table read by many indices: ``F.embedding(idx, table)`` with ``idx`` holding at least
``REPEATS`` times as many entries as ``table`` has rows, to ``opsmath::table_gather``
(``src/opsmath/kernels/table_gather.py``), whose backward sums each row's gradient without atomics.

The cases are T5's relative position bias (and its family: mT5, Flan-T5, UMT5, Switch): ``Embedding(32
buckets, heads)`` looked up at every (query, key) pair, whose gradient eager and Inductor scatter into 32
rows with contended atomic adds; and BERT's token-type embedding (2 rows, every token). A token embedding
(fewer lookups than rows) is not this family's; LongT5's local blocks read too few lookups per row.

Anchor: ``aten.embedding`` on a 2-D float table of at most ``ROWS`` rows that requires grad, integer
indices; symbolic index sizes (varying sequence lengths) are judged by their sizes at capture. Declined,
keeping eager, with ``padding_idx``, ``scale_grad_by_freq`` or sparse
gradients (whose semantics the op does not carry).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from opsmath.rewrite.canonicalize import aten, dtype, shape, size_hint
from opsmath.rewrite.match import RewriteContext, node_line
from opsmath.rewrite.rules import Rule, register_rule

REPEATS = 64      # lookups per table row from which atomic adds contend (and the rewrite pays)
# rows from which the one-hot products cost more than the atomics they replace: they grow as rows x lookups
# (H100, fp32, ``benchmarks/table_gather.py``: 32 rows x 262144 lookups 0.035 ms against compile's 0.555; 1024
# rows x 65536 lookups 8.2 ms against 0.01-0.31)
ROWS = 64
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_EMBEDDING_ARGS = ("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse")   # aten.embedding's


class TableGatherRule(Rule):
    name = "table_gather"
    anchors = (aten.embedding.default,)
    dynamic_shapes = True    # sound at any number of lookups; the threshold reads the sizes seen at capture

    def match(self, ctx: RewriteContext, n: fx.Node):
        table, idx = n.args[0], n.args[1]
        if not isinstance(table, fx.Node) or not isinstance(idx, fx.Node) or len(shape(table)) != 2 \
                or dtype(table) not in _FLOATS or dtype(idx) not in (torch.int32, torch.int64):
            return None
        if not all(isinstance(s, int) for s in shape(table)):
            return None
        rows, lookups = shape(table)[0], math.prod(size_hint(s) for s in shape(idx))
        if rows > ROWS or lookups < REPEATS * max(rows, 1) or not ctx.may_require_grad(table):
            return None
        given = {**dict(zip(_EMBEDDING_ARGS, n.args)), **n.kwargs}
        if given.get("padding_idx", -1) not in (-1, None) or given.get("scale_grad_by_freq") or given.get("sparse"):
            return ("padding_idx, scale_grad_by_freq or a sparse gradient: semantics opsmath::table_gather "
                    "does not carry")
        return table, idx, rows, lookups

    def emit(self, ctx: RewriteContext, n: fx.Node, plan) -> None:
        table, idx, rows, lookups = plan
        before = [node_line(n)]
        with ctx.graph.inserting_before(n):
            y = ctx.call(torch.ops.opsmath.table_gather.default, (table, idx), n)
        n.replace_all_uses_with(y)
        ctx.erase_dead([n])
        C = shape(table)[1]
        ctx.replaced(self.name, n, [n], f"opsmath::table_gather({rows} rows x {C}, {lookups} lookups: row "
                     "gradients summed without atomics)", before, rows=rows, width=C, lookups=lookups)


PATTERN = register_rule(TableGatherRule())
