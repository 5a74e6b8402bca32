"""``python -m opsmath``: the ``opsmath`` command (``opsmath.ui.cli``)."""
from opsmath.ui.cli import main

raise SystemExit(main())
