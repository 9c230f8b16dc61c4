"""A graph segment: one CUDA graph recorded between two eager calls. Every graph piecewise records is one: a Dynamo
piece at one size, the stretch of a breakable forward between two splitting-op calls, a full graph of the forward.

``begin`` starts capturing into the runner's pool (``capture_error_mode="thread_local"``: another thread's CUDA
calls are not this capture's business); ``end`` first joins the side streams the recorded code forked from the
capture stream and left open (``_compat.join_forks``), then ends the capture; ``abandon`` ends a capture that
failed and leaves CUDA usable; ``replay`` launches the graph.
"""

from __future__ import annotations

import threading
import warnings

import torch

from .. import _compat
from .state import CaptureState

_RUNNING = threading.local()


class runner_call:
    """``with runner_call():`` around a runner call: holds ``RUNNER_LOCK`` and marks this thread as inside one (a
    plain class: it runs on every call)."""

    __slots__ = ()

    def __enter__(self) -> None:
        RUNNER_LOCK.acquire()
        _RUNNING.depth = getattr(_RUNNING, "depth", 0) + 1

    def __exit__(self, *exc_info) -> None:
        _RUNNING.depth -= 1
        RUNNER_LOCK.release()


def in_runner_call() -> bool:
    """Whether this thread is inside a runner call (what a forward does then is the forward's)."""
    return getattr(_RUNNING, "depth", 0) > 0


RUNNER_LOCK = threading.RLock()
"""Held by every runner call (and so by every capture, which happens inside one): one runner runs at a time in a
process. While a graph captures, the device's random generator is in capture mode, and a random draw on a stream
that is not capturing fails ("Offset increment outside graph capture"); a runner serving in another thread would
draw one (a sampling op), or replay while the other captures. Uncontended it costs a fraction of a microsecond."""


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph now (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Segment:
    """One CUDA graph between two eager calls, recorded into ``state.pool``."""

    __slots__ = ("state", "graph", "stream")

    def __init__(self, state: CaptureState):
        self.state = state
        self.graph: torch.cuda.CUDAGraph | None = None
        self.stream = None

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.state.pool, capture_error_mode="thread_local")
        self.graph = graph
        self.stream = torch.cuda.current_stream()
        _compat.watch_forks(self.stream)

    def end(self) -> bool:
        """End the capture, after joining the side streams it forked; False when it recorded nothing (the segment
        holds no graph then). A capture that cannot end raises the ``RuntimeError`` after ``abandon``."""
        _compat.join_forks(self.stream)
        try:
            recorded = end_capture(self.graph)
        except RuntimeError:
            self.abandon(end_failed=True)
            raise
        if not recorded:
            self.graph = None
        return recorded

    def abandon(self, end_failed: bool = False) -> None:
        """End a capture that failed (``end_failed``: its ``capture_end`` already raised) and leave CUDA usable."""
        graph, self.graph = self.graph, None
        if graph is None:
            return
        if not end_failed:
            _compat.join_forks(self.stream)  # so that capture_end can close it
        abandon_capture(None if end_failed else graph, self.state)

    def replay(self) -> None:
        self.graph.replay()


_EMPTY_GRAPH = "The CUDA Graph is empty"


def end_capture(graph: torch.cuda.CUDAGraph) -> bool:
    """End ``graph``'s capture; False when it recorded nothing. torch's warning about an empty graph is kept
    from the user (an empty piece is expected: one made of views only); any other warning is passed on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph.capture_end()
    empty = False
    for warning in caught:
        if str(warning.message).startswith(_EMPTY_GRAPH):
            empty = True
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return not empty


def abandon_capture(graph: torch.cuda.CUDAGraph | None, state: CaptureState | None) -> None:
    """End a capture that failed (``graph``; None when its ``capture_end`` already raised), and leave CUDA usable
    for what follows.

    When ``capture_end`` fails (an invalidated capture, an unjoined side stream), torch tells neither the
    allocators nor the RNG generators that capture ended. The device allocator's recording to the pool is ended
    here; the pool is retired all the same (``CaptureState.retire_pool``: the pinned-host allocator's recording
    cannot be ended from Python). Every later random draw on the device would raise "Offset increment outside
    graph capture": one empty capture on a fresh stream ends the generators' capture state."""
    ended = False
    if graph is not None:
        try:
            graph.capture_end()
            ended = True
        except Exception:  # noqa: BLE001 - the capture is already invalid; the caller reports why
            pass
    torch.cuda.synchronize()
    if not ended and state is not None and state.pool is not None:
        end_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end_pool is not None:
            try:
                end_pool(torch.cuda.current_device(), state.pool)
            except RuntimeError:  # "not currently recording": capture_end got as far as ending it
                pass
        state.retire_pool()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        reset = torch.cuda.CUDAGraph()
        try:
            reset.capture_begin()
            end_capture(reset)
        except Exception:  # noqa: BLE001 - nothing was captured: nothing to undo
            pass
    torch.cuda.synchronize()
