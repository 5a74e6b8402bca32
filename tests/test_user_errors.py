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


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(self.lin(x), dim=-1).sum()


def test_ctrl_c_during_capture_is_taken_when_the_graph_is_done(monkeypatch):
    """A SIGINT in the middle of opsmath's compile does not cut it: the compile finishes, then the call raises
    KeyboardInterrupt; the handler is the default again and the next call trains as eager does."""
    import os
    import signal

    import opsmath.runtime.backend as backend
    done, real = [], backend.compile_graph

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)     # delivered now, between two bytecodes of ours
        out = real(*args, **kwargs)
        done.append(True)                       # reached: the interrupt did not cut the compile
        return out

    torch.manual_seed(0)
    ref, x = Tiny(), torch.randn(4, 8)
    opt = opsmath.optimize(Tiny(), inductor=False)
    opt.load_state_dict(ref.state_dict())
    # Python's default handler, as in a user's script (a pytest-xdist worker ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        monkeypatch.setattr(backend, "compile_graph", interrupted)
        with pytest.raises(KeyboardInterrupt):
            opt(x)
        assert done and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.setattr(backend, "compile_graph", real)
    opt(x).backward()
    ref(x).backward()
    for a, b in zip(opt.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_a_users_own_sigint_handler_is_left_alone():
    import signal

    from opsmath.capture.interrupts import interrupts_deferred
    mine = lambda signum, frame: None   # noqa: E731
    previous = signal.signal(signal.SIGINT, mine)
    try:
        with interrupts_deferred():
            assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)
