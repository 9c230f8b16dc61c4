"""The forward context: what a splitting op may ask about the call it runs in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardContext:
    """Visible to splitting ops through ``piecewise.context()``."""

    num_tokens: int
    """Real token count of this call."""
    padded_tokens: int
    """Token count the captured pieces run at (the capture size, or ``num_tokens`` without graphs)."""
    capturing: bool = False
    """True while CUDA graphs are being recorded (kernels launched now are recorded, not run)."""
    rehearsal: bool = False
    """True in the runs of a runner's first call that only warm up, trace and capture (their results are
    discarded; the call then runs once more for real). A splitting op that accumulates state (a counter, a
    running sum) skips the update when this is True, so the update happens once per call."""


_current: list[ForwardContext] = []


def context() -> ForwardContext | None:
    """The context of the piecewise call in progress, or None outside one (e.g. plain eager)."""
    return _current[-1] if _current else None


class forward_context:
    """``with forward_context(num_tokens, padded_tokens):`` makes that context current (a plain class: this
    runs on every call, and a generator-based context manager costs several times more)."""

    __slots__ = ("ctx",)

    def __init__(self, num_tokens: int, padded_tokens: int, capturing: bool = False, rehearsal: bool = False):
        self.ctx = ForwardContext(num_tokens, padded_tokens, capturing, rehearsal)

    def __enter__(self) -> ForwardContext:
        _current.append(self.ctx)
        return self.ctx

    def __exit__(self, *exc_info) -> None:
        _current.pop()
