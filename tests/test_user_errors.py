"""A mistake in the user's own code (a shape that does not fit) raises eager's error, with a traceback of
eager's length that ends in the user's line, not one chained to the tracer's."""
import traceback

import pytest
import torch
import torch.nn as nn

import opsmath


class Mismatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(7, 3))

    def forward(self, x):
        return (x @ self.w).sum()   # x is (2, 5): the user's mistake


def _trace(fn) -> list[str]:
    with pytest.raises(RuntimeError) as info:
        fn()
    return traceback.format_exception(info.value)


def test_user_error_reads_as_eagers():
    x = torch.randn(2, 5)
    eager = _trace(lambda: Mismatch()(x))
    opt = opsmath.optimize(Mismatch())
    got = _trace(lambda: opt(x))
    assert got[-1] == eager[-1]                               # the same error
    assert "x @ self.w" in "".join(got[-3:])                  # at the user's line
    assert len("".join(got).splitlines()) <= 2 * len("".join(eager).splitlines()) + 10
    assert "During handling of the above exception" not in "".join(got)


class Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(10, 8), nn.Embedding(16, 8)

    def forward(self, ids, pos):
        return (self.tok(ids) + self.pos(pos)).sum()   # pos past 16: the user's mistake


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes need Python 3.11")
def test_error_inside_the_captured_graph_names_the_users_line():
    """An out-of-range position after capture raises inside fx's generated code; the error carries the user's
    line (this file's ``forward``) as a note."""
    opt = opsmath.optimize(Positions(), inductor=False)
    ids, pos = torch.randint(0, 10, (2, 8)), torch.arange(8).expand(2, 8)
    opt(ids, pos).backward()
    with pytest.raises(IndexError) as info:
        opt(ids, pos + 20)
    notes = getattr(info.value, "__notes__", [])
    assert any("test_user_errors.py" in n and "self.pos(pos)" in n for n in notes), notes
