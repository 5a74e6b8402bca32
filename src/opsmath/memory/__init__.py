"""Stage 3, memory: a rewritten ATen graph and a byte budget in; a plan (recompute, selective recompute,
weight-cast recompute, offload) and the graph tagged to carry it out.

``analysis`` measures what autograd saves per node (fake tensors); ``segments`` and ``selective`` name
the candidates, ``op_times`` and ``offload`` price them, ``plan_solve`` and ``plan_choice`` choose
(an exact knapsack over positions), ``plan_emit`` tags the graph, ``plan`` sequences it all and
``replan`` checks the first measured steps against the plan; ``plan_chart`` draws it. ``budget`` parses budgets and counts the
bytes that are resident besides activations. Nothing here knows a rewrite family.
"""
