"""One way to show a result object: rich in a terminal, plain text from ``str()``, HTML in Jupyter.

A class defines ``__rich_console__`` and inherits :class:`Rendered`; ``text_width`` and ``html_width``
set the columns it is laid out in.
"""
from __future__ import annotations

import io

from rich.console import Console


class Rendered:
    text_width = 100
    html_width = 110

    def render(self, width: int | None = None, color: bool = False) -> str:
        """The object as text, ``width`` columns wide (ANSI colors only if ``color``)."""
        buf = io.StringIO()
        Console(file=buf, width=width or self.text_width, force_terminal=color,
                color_system="standard" if color else None, soft_wrap=False).print(self)
        return buf.getvalue()

    def __str__(self) -> str:
        return self.render()

    def _repr_html_(self) -> str:
        console = Console(record=True, width=self.html_width, file=io.StringIO())
        console.print(self)
        return console.export_html(inline_styles=True)
