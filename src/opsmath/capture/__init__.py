"""Stage 1, capture: dynamo's Torch-level graph in; pre-dispatch ATen graphs with fake-tensor metadata out.

``regions`` cuts out what must stay eager (autograd Functions, tensor hooks) and splits the graph into
pieces around it (``pieces``: each compiled on its first call); ``lower`` re-traces a piece to ATen
(``lower_to_aten``), attributing every node to the user's source line; ``guards`` re-captures when a
buffer the graph read as a constant changes. Nothing here knows a rewrite family or the planner.
"""
