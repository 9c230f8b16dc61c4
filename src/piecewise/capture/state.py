"""What the runners of one compiled model share: the call being run (one frozen descriptor) and the pool."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch


STATE_CHANGE = "a guard on model state failed"
"""What ``Arguments.describe_change`` says when no argument changed: a retrace came from the model's own Python
state."""


class Phase(enum.Enum):
    """What a call does with the graphs."""

    DIRECT = "direct"
    """No padding, no graphs (above the top of the graphs, or outside a piecewise call)."""
    PADDED = "padded"
    """Padded to the capture size; everything runs without graphs (CPU, rehearsals, a size with no graph)."""
    CAPTURE = "capture"
    """Padded; each piece records its graph for this size, then replays it once."""
    REPLAY = "replay"
    """Padded; each piece replays its graph for this size."""


@dataclass(frozen=True)
class Call:
    """One call, decided by the runtime before the forward runs and read by every runner."""

    phase: Phase
    size: int
    """Token count the pieces run at: the capture size, or the real count for a direct call."""
    num_tokens: int
    """Real token count."""
    full: bool = False
    """A full-graph call: capturable splitting ops run on the padded rows, inside the graph of the forward."""
    checked: bool = False
    """A rehearsal whose ops' index bounds are checked (``runtime.bounds``): compiled pieces run their FX graph
    instead, op by op, so that the check sees each."""


IDLE = Call(Phase.DIRECT, 0, 0)


@dataclass
class CaptureState:
    """Shared by the runners of one compiled model. ``call`` is written only by ``PiecewiseModel.run_call``."""

    max_tokens: int
    call: Call = IDLE
    graphs_enabled: bool = False
    capture_done: bool = False
    preparing: bool = False
    """The first call is running its checks, warm-up and captures (``first_call.prepare``)."""
    pool: Any = None
    """The graph pool captures go into (``capture_session`` makes it)."""
    retired_pools: list[Any] = field(default_factory=list)
    """Pools a capture failed in (``retire_pool``); the graphs captured into them before keep them alive."""
    workspace_graph: Any = None
    """The throwaway capture that made the capture stream's cuBLAS workspaces inside ``pool``."""
    static_storages: set[int] = field(default_factory=set)
    """Storages of the model's parameters and buffers and of its static arguments."""
    stable_ptrs: set[int] = field(default_factory=set)
    """Addresses that never move: parameters, buffers, static arguments, piecewise's input buffers."""
    outside_reads: list[Any] = field(default_factory=list)
    """Tensors captured custom ops read from outside their arguments (``runtime/op_reads.py``)."""
    buffer_storages: set[int] = field(default_factory=set)
    """Storages of the splitting calls' output buffers (outside the graph pool)."""
    token_outputs: dict[int, int | None] = field(default_factory=dict)
    """id of each tensor the forward returned in this call → its token dimension (None: it has none), where the
    front-end knows it (``PiecewiseModel.finish`` cuts the others by their shape)."""
    captured_this_size: list[Any] = field(default_factory=list)
    """Runners that recorded a graph for the size being captured (their outputs become non-owning aliases)."""
    replays: int = 0
    splitting_op_calls: int = 0
    bounds: Any = None
    """The ``BoundsCheck`` of a rehearsal run with ``Call.checked``."""
    probe: list | None = None
    """``verify`` sets a list here: every splitting-op call appends the tensors it is given (real rows)."""
    cut_runs: int = 0
    """Runs of in-place writes into static tensors cut out of the pieces (``SplitCall.cut``) on a call's real rows."""
    full_exact: bool = False
    """Full graphs hold such writes: each serves only calls of exactly its size (no pad row to write)."""
    host_branch: str | None = None
    """A ``torch.cond`` (``SplitCall.host``) that ran: no full graph can hold it."""

    def retire_pool(self) -> None:
        """Give later captures a fresh pool after a capture that failed to end in ``pool``.

        torch (2.11 on) then leaves the pool marked as recorded to in its pinned-host allocator as well as in the
        device one, and only the device one can be ended from Python: a later capture into the pool raises
        "beginAllocateToPool: already recording to mempool_id", and, raising after its generators' prologue, breaks
        every later random draw on the device."""
        self.retired_pools.append(self.pool)
        self.pool = torch.cuda.graph_pool_handle()

    def pools(self) -> list[Any]:
        """Every pool that holds graphs: the retired ones and the current one."""
        return [*self.retired_pools, *([self.pool] if self.pool is not None else [])]

    def pool_bytes(self) -> int:
        """Bytes the graph pools hold (0 where the allocator cannot say)."""
        return sum(_pool_bytes(pool) or 0 for pool in self.pools())


def probe_call(state: CaptureState, args: Any, kwargs: Any = None) -> None:
    """Record a splitting-op call's tensor inputs for ``verify`` (copies: the buffers are overwritten later)."""
    leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
    state.probe.append([leaf.detach().clone() for leaf in leaves if isinstance(leaf, torch.Tensor)])


def _pool_bytes(pool: Any) -> int | None:
    """Bytes reserved by the CUDA graph memory pool ``pool`` (None if the allocator cannot say)."""
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:  # pragma: no cover - allocator without snapshots
        return None
    wanted = tuple(pool) if isinstance(pool, (tuple, list)) else pool
    total = 0
    for segment in segments:
        pool_id = segment.get("segment_pool_id")
        if pool_id is not None and tuple(pool_id) == wanted:
            total += int(segment.get("total_size", 0))
    return total
