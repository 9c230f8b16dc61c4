"""What a runner did, as a typed object tests can ``expect(...)`` on; it reads like a dict for printing."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Stats(MutableMapping):
    """Counters and facts of one ``PiecewiseModel`` (``runner.stats``)."""

    frontend: str = ""
    """The front-end in use: ``"dynamo"`` or ``"breakable"`` (empty before the first call)."""
    frontend_reason: str = ""
    """Why ``frontend="auto"`` chose it."""
    pieces: int = 0
    """Captured pieces per size: FX pieces (Dynamo) or graph segments between splitting-op calls (breakable)."""
    splitting_op_calls: int = 0
    """Splitting-op calls in the last call."""
    eager_writes: int = 0
    """In-place writes into static tensors cut out of the pieces and run between them (Dynamo)."""
    outside_reads: list[str] = field(default_factory=list)
    """Tensors a custom op captured into a graph reads that are not among its arguments (a global forward
    context): the graphs read them where they were at capture; a call finding one freed runs eagerly."""
    capture_sizes: list[int] = field(default_factory=list)
    """Token counts that get graphs."""
    size_notes: list[str] = field(default_factory=list)
    """Why the capture sizes differ from the configured ones (e.g. one-token calls padded to 2)."""
    captured_sizes: list[int] = field(default_factory=list)
    """Sizes captured as piecewise graphs."""
    full_only_sizes: list[int] = field(default_factory=list)
    """Sizes with a full graph serving every call they pad: no piecewise graphs captured (never replayed)."""
    warmed_sizes: list[int] = field(default_factory=list)
    """Piecewise sizes run padded before their capture. Breakable does so for the first (largest) size, for a size
    whose capture failed without it (first-use host work: a tuning sync, an upload), captured again after it, and
    for every size after a failure that retired the pool; Dynamo, and breakable under ``torch.distributed``, for
    every size. (Full graphs: ``full_warmed_sizes``.)"""
    full_warmed_sizes: list[int] = field(default_factory=list)
    """Full-graph sizes run padded before their capture: by the same rule as piecewise sizes (``warmed_sizes``)."""
    graphs: int = 0
    capture_seconds: float = 0.0
    pool_bytes: int = 0
    cuda_graphs: bool = False
    replays: int = 0
    """Graph replays: one per piece and size replayed, one per full graph replayed (``full_replays``)."""
    fallback_calls: int = 0
    """Calls run without padding or graphs: above the top of the graphs, or over ``max_padding_factor``."""
    padded_calls: int = 0
    eager_calls: int = 0
    """Calls that ran the model's own forward: they differ from the first call in what the graphs depend on (an
    argument's dtype or device, autocast, train mode, a Python argument; ``runtime/guards.py``), with one warning
    per difference."""
    traces: int = 0
    """Dynamo traces (0 with the breakable front-end)."""
    direct_calls: int = 0
    """Calls that skipped Dynamo's frame hook (Dynamo front-end)."""
    graph_breaks: int = 0
    candidates: list = field(default_factory=list)
    """``compiler="auto"``: each candidate compiler's first-call seconds and ms per call at the sizes timed (or
    the error that stopped it)."""
    cache: str = ""
    """The persistent cache at the first call: ``"off"``, ``"miss"`` (an entry written after it), ``"hit"`` (the
    front-end recorded there taken directly), ``"hit, front-end given by the config"`` (an explicit ``frontend``:
    only the compiler choice recorded there is taken) or ``"hit, not taken: ..."``."""
    compiled_regions: int = 0
    """Regions of the forward Inductor compiled under the breakable front-end (``compiler="inductor"``): the code
    between Dynamo's graph breaks; what lies outside them runs op by op while capturing."""
    graph_mode: str = ""
    """``"piecewise"``, ``"full"`` or ``"full_and_piecewise"`` (``CaptureConfig.graph_mode``, resolved)."""
    graph_mode_reason: str = ""
    full_sizes: list[int] = field(default_factory=list)
    """Sizes served by full graphs (one graph of the whole forward each)."""
    full_graphs: int = 0
    full_calls: int = 0
    """Calls served by the full-graph family (replayed, or padded without graphs on a CPU)."""
    full_replays: int = 0
    verified_sizes: list[int] = field(default_factory=list)
    """Sizes ``CaptureConfig(verify=...)`` checked against eager at the first call."""
    verify_seconds: float = 0.0
    prewarm_seconds: float = 0.0
    compile_seconds: float = 0.0
    first_call_seconds: dict = field(default_factory=dict)
    """Where the first call's seconds went, phase by phase in the order run (``"warm-up"``, ``"front-end"``,
    ``"padding check"`` (Dynamo's trace and the pieces' compile happen there), ``"one-token check"``, ``"sizes"``,
    ``"full-graph check"``, ``"capture"``, ``"count check"``, ``"verify"``, ``"cache"``); a front-end ``auto`` left
    adds its seconds to the phases it reached."""
    pieces_shared: int = 0
    """Pieces that took the compiled code of an earlier identical piece (a model's layers) instead of compiling
    (``compiler="inductor"``; see ``capture.compilers.piece_key``)."""

    def __getitem__(self, key: str) -> Any:
        if key not in _FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in _FIELDS:
            raise KeyError(f"Stats has no field {key!r}; fields: {sorted(_FIELDS)}")
        setattr(self, key, value)

    def __delitem__(self, key: str) -> None:
        raise TypeError("Stats fields cannot be deleted")

    def __iter__(self) -> Iterator[str]:
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)

    def __repr__(self) -> str:
        return f"Stats({dict(self)!r})"

    def expect(self, **expected: Any) -> None:
        """Raise ``AssertionError`` listing every field whose value differs from ``expected``."""
        unknown = sorted(set(expected) - set(_FIELDS))
        if unknown:
            raise KeyError(f"Stats has no field(s) {unknown}; fields: {sorted(_FIELDS)}")
        wrong = {key: (getattr(self, key), value) for key, value in expected.items() if getattr(self, key) != value}
        if wrong:
            raise AssertionError("; ".join(f"{key}: {got!r} != expected {want!r}" for key, (got, want) in wrong.items()))


_FIELDS = tuple(f.name for f in dataclasses.fields(Stats))
