"""The forward context: what a splitting op may ask about the call it runs in."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


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
    token_mask: Any = None
    """In a call served by a full graph (``CaptureConfig.graph_mode``): a device bool tensor [padded_tokens],
    True for the real rows. Capturable splitting ops then run on the padded rows and must leave other rows'
    state alone: ``redirect_padding`` does it for index-and-value writes. None otherwise (the op sees only the
    real rows)."""


class _Stack(threading.local):
    """Each thread's own stack of contexts: a runner serving in one thread never sees another thread's call."""

    def __init__(self) -> None:
        self.items: list[ForwardContext] = []


_stack = _Stack()


def context() -> ForwardContext | None:
    """The context of the piecewise call in progress in this thread, or None outside one (e.g. plain eager)."""
    items = _stack.items
    return items[-1] if items else None


class forward_context:
    """``with forward_context(num_tokens, padded_tokens):`` makes that context current (a plain class: this
    runs on every call, and a generator-based context manager costs several times more)."""

    __slots__ = ("ctx",)

    def __init__(self, num_tokens: int, padded_tokens: int, capturing: bool = False, rehearsal: bool = False,
                 token_mask: Any = None):
        self.ctx = ForwardContext(num_tokens, padded_tokens, capturing, rehearsal, token_mask)

    def __enter__(self) -> ForwardContext:
        _stack.items.append(self.ctx)
        return self.ctx

    def __exit__(self, *exc_info) -> None:
        _stack.items.pop()


def redirect_padding(*tensors: Any) -> tuple:
    """For a capturable splitting op in a full-graph call: each tensor (indices or values, tokens first) with its
    pad rows replaced by its first row, so that the pad rows write exactly what the first (real) row writes, at
    the same place: a write of ``values`` at ``indices`` then changes nothing the real rows do not. Outside a
    full-graph call, the tensors as they are."""
    ctx = context()
    mask = ctx.token_mask if ctx is not None else None
    if mask is None:
        return tensors
    import torch

    return tuple(torch.where(mask.view(-1, *[1] * (t.dim() - 1)), t, t[:1]) for t in tensors)
