"""Stage 4, runtime: a planned graph in; the callable dynamo runs each step out.

``backend`` is the dynamo backend that sequences the stages (capture → rewrite → memory → Inductor or
op by op, with its fallback ladder); ``cudagraphs`` records whole steps; ``fp8_weights`` keeps the
per-step FP8 weight copies; ``offload_ops`` and ``offload_async`` move saved activations to the host
and back on a side stream.
"""
