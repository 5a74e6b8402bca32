"""Stage 2, rewrite: an ATen graph in; the same graph with fused ``opsmath::`` ops and a record of every
match and decline out.

``normalize`` removes what only hides a match (dead code, einsums spelled as matmuls);
``canonicalize`` is the vocabulary rules read the graph with (through casts and views); ``rules`` is the
interface a family implements (``Rule``, ``register_rule``), ``declare`` the declarative form;
``match`` offers each rule its anchors and records ``Match``/``Decline``; ``unmatched`` lists the
candidates no rule took. The families live in ``opsmath.patterns``; nothing here knows one of them.
"""
