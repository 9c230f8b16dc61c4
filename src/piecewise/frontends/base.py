"""The front-end interface: ``Parts`` (what a front-end is given of the runtime), ``Frontend`` (what the runtime
asks of it) and the registry of front-ends by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..capture.buffers import InputStager
from ..capture.ladder import Ladder
from ..capture.state import CaptureState
from ..capture.stats import Stats
from ..config import FRONTENDS, CaptureConfig


@dataclass(frozen=True)
class Parts:
    """What a front-end is given of the runtime."""

    model: torch.nn.Module
    config: CaptureConfig
    state: CaptureState
    ladder: Ladder
    stats: Stats
    stager: InputStager
    describe_change: Callable[[], str]
    """What changed in the arguments since the first call (for a retrace's message)."""
    token_names: Callable[[], list[str]]
    """The forward's token arguments."""


class Frontend(Protocol):
    """What the runtime asks of a front-end."""

    name: str
    runs_every_size: bool
    """Whether the first call runs the forward at every capture size even without CUDA graphs (its checks compare
    those runs)."""
    replays_python: bool
    """Whether a replayed call runs the forward's Python (Dynamo's bytecode around the graphs) or none of it."""

    def takes_op_watch(self, watch: Any) -> bool:
        """Whether the front-end runs every op of the captures through ``watch`` (``op_reads.Watch.run``) itself,
        so that the runtime does not enter it as a dispatch mode (None: the captures are over)."""

    def runs_custom_ops(self) -> bool:
        """Whether a custom op other than the splitting ops may run while the graphs capture (their reads are
        watched then: ``runtime/op_reads.py``); True where the front-end cannot tell."""

    def check_state(self, arguments: dict[str, Any], full: bool) -> None:
        """After the first call, before a padded call (``full``: served by a full graph): raise ``StateChanged``
        where the model's state the graphs depend on changed and the model's own forward can serve the call, or
        another error naming what to do."""

    def prepare(self, rehearse: Callable[[int], Any], tokens: int) -> None:
        """Before the padding check: ``rehearse(n)`` runs the forward unpadded at ``n`` tokens (the first call's
        leading rows; ``tokens + 1``: its first row repeated)."""

    def run(self, arguments: dict[str, Any]) -> Any:
        """The forward on ``arguments`` for the call in ``state.call`` (``Phase.DIRECT``: the caller's tensors, no
        padding; ``PADDED``: staged buffers of ``call.size`` rows, no graphs; ``CAPTURE``: the same, recording this
        size's graphs; ``REPLAY``: this size's graphs replayed). Splitting ops see only ``call.num_tokens`` rows
        (``SplitCall``). Runners that recorded a graph for the size being captured go into
        ``state.captured_this_size`` (``release_outputs(size)`` then makes their pool tensors non-owning)."""

    def splitting_ops(self) -> frozenset[str]:
        """The ops it cuts at."""

    def release(self) -> None:
        """Drop every graph; later calls run the same forward without them."""

    def graph_count(self) -> int:
        """Graphs held."""

    def mixing_hint(self) -> tuple[str, list]:
        """Where the forward may combine token rows, for the padding check's message, and that place's frames."""


REGISTRY: dict[str, Callable[..., Frontend]] = {}
"""Front-end name → its class, called with ``Parts`` and the class's own options."""


def register(cls: type) -> type:
    """Class decorator: add a front-end to ``REGISTRY`` under its ``name``, which ``config.FRONTENDS`` lists."""
    if cls.name not in FRONTENDS or cls.name == "auto":
        raise ValueError(f"front-end {cls.name!r} is not one of config.FRONTENDS {FRONTENDS}")
    REGISTRY[cls.name] = cls
    return cls
