"""The capture sizes of one runner, and which size a call pads to."""

from __future__ import annotations

import bisect


class Ladder:
    """Capture sizes, ascending. The configured ladder; the Dynamo front-end may drop size 1 (``drop_one``)."""

    def __init__(self, sizes: list[int], max_padding_factor: float | None = None):
        self.sizes = list(sizes)
        self.max_padding_factor = max_padding_factor
        self.notes: list[str] = []

    @property
    def top(self) -> int:
        """The largest capture size: calls above it run without graphs."""
        return self.sizes[-1]

    def bucket(self, tokens: int) -> int | None:
        """The capture size a call of ``tokens`` pads to, or None when it runs without graphs (above the top,
        or padded by more than ``max_padding_factor``)."""
        if tokens > self.sizes[-1]:
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, tokens)]
        if self.max_padding_factor is not None and size > self.max_padding_factor * tokens:
            return None
        return size

    def drop_above(self, size: int, reason: str) -> None:
        """Serve no call of more than ``size`` tokens with graphs (they run without padding)."""
        self.sizes[:] = [s for s in self.sizes if s <= size]  # in place: the stats hold this list
        self.notes.append(reason)

    def drop_one(self, reason: str) -> None:
        """Serve one-token calls with the next size (a trace that only holds for more than one token)."""
        if len(self.sizes) > 1 and self.sizes[0] == 1:
            del self.sizes[0]  # in place: the stats hold this list
            self.notes.append(f"calls of 1 token are padded to {self.sizes[0]}: {reason}")
