"""Stage 5, what the user sees: an optimized model (and its records) in; text, HTML, JSON and charts out.

``report`` (the graph diff report), ``explore`` (candidates before committing), ``verify`` (numerics
against eager by docs/design.md's rule), ``profile`` (kernels and time per op class) and ``fp8_stats``, rendered through ``rendering``; ``cli`` is the ``opsmath`` command.
"""
