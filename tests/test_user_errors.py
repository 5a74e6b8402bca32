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


class _Breaks(nn.Module):
    """A graph break in the model's own code (``.item()``) and one inside torch's ``nn.Transformer``
    (its causal-mask check compares a tensor, unless ``tgt_is_causal`` is given)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.tf = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True)

    def forward(self, x):
        h = self.lin(x)
        scale = h.abs().max().item()   # break in the model's code
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.tf(h / scale, h, tgt_mask=mask).sum()


def test_graph_breaks_name_their_line_without_printing_dynamos_log(capfd):
    torch._dynamo.reset()
    opt = opsmath.optimize(_Breaks())
    opt(torch.randn(2, 5, 8)).backward()
    breaks = {r.location: r for r in opsmath.report(opt).eager_regions if r.kind == "graph break"}
    mine = f"test_user_errors.py:{_Breaks.forward.__code__.co_firstlineno + 2}"
    assert mine in breaks and ".item()" in breaks[mine].code, breaks
    inside = [loc for loc in breaks if loc.startswith("torch/nn/modules/transformer.py:")]
    assert inside and "mask" in breaks[inside[0]].code, breaks
    assert "Graph break in user code" not in capfd.readouterr().err


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        x = self.lin(x)
        for i in (x.sum(-1) > 0).nonzero():    # iterates a data-dependent index (DBRX's experts: ``for e in hit``)
            x = x + i[0]
        return x


class _LoopBreak(nn.Module):
    """Blocks in a loop, each breaking inside its own loop. Under the experts family's dynamo settings (a
    data-dependent size traced, not a break) the block's break is one dynamo cannot resume from, inside the
    caller's loop: dynamo skips the caller's whole frame, which then runs as plain Python."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([_Block() for _ in range(2)])

    def forward(self, x):
        for block in self.experts:
            x = block(x)
        return x.sum()


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < (2, 11),
                    reason="dynamo logs a frame it skips for a break in a loop from torch 2.11 on")
def test_a_frame_dynamo_skips_for_a_break_in_a_loop_is_reported():
    torch._dynamo.reset()
    opt = opsmath.optimize(_LoopBreak())
    opt(torch.randn(4, 8)).backward()
    breaks = [(r.location, r.reason) for r in opsmath.report(opt).eager_regions if r.kind == "graph break"]
    line = _LoopBreak.forward.__code__.co_firstlineno
    assert any("graph break in loop" in why and f"frame skipped: forward at test_user_errors.py:{line}" in why
               for _, why in breaks), breaks
    assert any("data-dependent" in why for _, why in breaks), breaks
