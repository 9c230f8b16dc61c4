"""The breakable front-end: no tracing. The model's own Python runs under stream capture, per capture size; each
splitting-op call ends the current CUDA graph, runs eagerly on the real rows (into static buffers), and the
next graph begins. Replay runs the size's graphs and recorded calls in order, with no model Python at all.

A ``TorchDispatchMode`` sees every op of the forward while it runs padded (never on replay):
- splitting ops (``opaque_op(..., split=True)`` or ``CaptureConfig.splitting_ops``) become break points;
- an in-place write into a static tensor (a KV cache) that takes token rows becomes one too, so it runs on
  the real rows only (inside a graph it would also write the padding rows, at position 0);
- what padding or the repeated first-call runs would break is refused with the model's line: an update of
  state from its own value, a write into a token argument, and, while capturing, a host synchronisation.
Python that Dynamo cannot trace (a JIT library's subprocess, a lock) simply runs: its kernels are recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import _compat
from ..capture.buffers import InputStager, RowBuffer, map_tensors
from ..capture.pieces import abandon_capture, end_capture
from ..capture.state import CaptureState, Phase, probe_call
from ..capture.stats import Stats
from ..config import CaptureConfig
from ..context import context, forward_context
from ..errors import CaptureFailed, ForwardRefused
from ..graph.writes import ACCUMULATING_METHODS
from ..opaque import opaque_op_info, resolve_splitting_ops
from .user_frames import chain_text, user_chain

logger = logging.getLogger(__name__)

# Ops that wait for the device (their result goes to the host): illegal while a CUDA graph captures.
_HOST_SYNC = frozenset({
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim",
    "aten::unique_consecutive", "aten::equal", "aten::is_nonzero",
})


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _Step:
    """One splitting-op call (or cut-out write) recorded at capture, replayed between two graphs."""

    __slots__ = ("call", "leaves", "spec", "token_leaves", "zero_after", "buffers", "single", "sliced", "probed")

    def __init__(self, call: Callable, leaves: list, spec: Any, token_leaves: list[int], zero_after: list[int],
                 buffers: list[RowBuffer | None], single: bool, probed: bool):
        self.probed = probed
        """A splitting op of the model (not a cut-out write): ``verify`` records its inputs."""
        self.call, self.leaves, self.spec = call, leaves, spec
        self.token_leaves, self.zero_after = token_leaves, zero_after
        self.buffers, self.single = buffers, single
        self.sliced: dict[int, tuple[tuple, dict]] = {}

    def arguments(self, rows: int, size: int) -> tuple[tuple, dict]:
        cached = self.sliced.get(rows)
        if cached is None:
            leaves = list(self.leaves)
            if rows != size:
                for index in self.token_leaves:
                    leaves[index] = leaves[index][:rows]
            cached = self.sliced[rows] = tree_unflatten(leaves, self.spec)
        return cached

    def run(self, rows: int, size: int, state: CaptureState) -> None:
        args, kwargs = self.arguments(rows, size)
        if state.probe is not None and self.probed:
            probe_call(state, args, kwargs)
        result = self.call(*args, **kwargs)
        for index in self.zero_after:
            if rows != size:
                self.leaves[index][rows:size].zero_()
        if result is None:
            return
        for buffer, value in zip(self.buffers, [result] if self.single else result):
            if buffer is not None:
                buffer.write(value, rows)

    def release(self, keep: Callable[[torch.Tensor], bool]) -> None:
        """Hold pool tensors as non-owning aliases, so that the pool can serve other sizes."""
        self.leaves = [leaf if not isinstance(leaf, torch.Tensor) or keep(leaf) else _compat.non_owning_alias(leaf)
                       for leaf in self.leaves]
        self.sliced.clear()


class Recording:
    """One size's graphs and recorded calls, in order, and the forward's output."""

    def __init__(self, size: int):
        self.size = size
        self.steps: list[Any] = []  # torch.cuda.CUDAGraph or _Step
        self.output: Any = None
        self.keep: Callable[[torch.Tensor], bool] = lambda tensor: True

    @property
    def graphs(self) -> int:
        return sum(1 for step in self.steps if isinstance(step, torch.cuda.CUDAGraph))

    def replay(self, rows: int, state: CaptureState) -> Any:
        size = self.size
        for step in self.steps:
            if isinstance(step, _Step):
                step.run(rows, size, state)
            else:
                step.replay()
        return self.output

    def release_outputs(self, size: int) -> None:
        for step in self.steps:
            if isinstance(step, _Step):
                step.release(self.keep)
        self.output = map_tensors(self.output, lambda t: t if self.keep(t) else _compat.non_owning_alias(t))


class BreakableFrontend:
    """Runs the model's Python per size under capture; replays the recorded graphs and calls."""

    name = "breakable"

    def __init__(self, model: torch.nn.Module, config: CaptureConfig, state: CaptureState, stats: Stats,
                 stager: InputStager, static_tensors: list[torch.Tensor]):
        self.model = model
        self.state = state
        self.stats = stats
        self.stager = stager
        self.splitting = resolve_splitting_ops(config.splitting_ops)
        self.static = {_storage(t) for t in [*model.parameters(), *model.buffers(), *static_tensors]}
        self.recordings: dict[int, Recording] = {}
        self.buffers: dict[tuple[int, int], RowBuffer] = {}  # (call index in the forward, output) → buffer
        self.buffer_storages: set[int] = set()
        self.graphs_allowed = True
        self.kinds: dict[Any, str] = {}
        """Op overload → what the interceptor does with it (``_kind``), decided once per op."""

    def run(self, arguments: dict[str, Any]) -> Any:
        """The forward on ``arguments`` for ``state.call``: plain (direct), padded, captured or replayed."""
        call = self.state.call
        if call.phase is Phase.DIRECT:
            return self.model(**arguments)
        if call.phase is Phase.REPLAY:
            recording = self.recordings.get(call.size)
            if recording is not None:
                output = recording.replay(call.num_tokens, self.state)
                self.state.replays += recording.graphs
                self.stats.replays += recording.graphs
                self.state.splitting_op_calls = len(recording.steps) - recording.graphs
                return output
        capturing = call.phase is Phase.CAPTURE and self.graphs_allowed
        recording = Recording(call.size) if capturing else None
        with _Interceptor(self, call.num_tokens, call.size, recording) as interceptor:
            output = interceptor.forward(arguments)
        if recording is not None:
            recording.output = output
            recording.keep = self._keeps
            self.recordings[call.size] = recording
            self.state.captured_this_size.append(recording)
        self.stats.pieces = max(self.stats.pieces, interceptor.calls + 1)
        return output

    def add_static(self, tensor: torch.Tensor) -> None:
        """A static argument first given after the first call (a KV cache): writes into it are cut too."""
        self.static.add(_storage(tensor))

    def _keeps(self, tensor: torch.Tensor) -> bool:
        """Whether a recorded tensor lives outside the graph pool (static, staged or a splitting-op buffer)."""
        pointer = _storage(tensor)
        return pointer in self.static or pointer in self.buffer_storages or self.stager.owns(tensor)

    def release(self) -> None:
        self.recordings.clear()
        self.graphs_allowed = False

    def graph_count(self) -> int:
        return sum(recording.graphs for recording in self.recordings.values())

    def mixing_hint(self) -> tuple[str, list]:
        return "", []

    def buffer(self, index: int, output: int, value: torch.Tensor) -> RowBuffer:
        key = (index, output)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.buffer.dtype != value.dtype or buffer.buffer.shape[1:] != value.shape[1:]:
            shape = (self.state.max_tokens, *value.shape[1:])
            buffer = self.buffers[key] = RowBuffer(torch.zeros(shape, dtype=value.dtype, device=value.device))
            self.buffer_storages.add(_storage(buffer.buffer))
        return buffer


class _Interceptor(TorchDispatchMode):
    """The forward of one padded call: splitting ops on the real rows, graphs cut around them when capturing."""

    def __init__(self, frontend: BreakableFrontend, rows: int, size: int, recording: Recording | None):
        super().__init__()
        self.frontend, self.rows, self.size, self.recording = frontend, rows, size, recording
        self.graph: torch.cuda.CUDAGraph | None = None
        self.calls = 0
        self.where = "the start of the forward"

    def forward(self, arguments: dict[str, Any]) -> Any:
        self._begin()
        try:
            output = self.frontend.model(**arguments)
        except BaseException:
            self._abort()
            raise
        self._end(at="the end of the forward")
        return output

    # --- graphs -----------------------------------------------------------------------------------------

    def _begin(self) -> None:
        if self.recording is None:
            return
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.frontend.state.pool)

    def _end(self, at: str) -> None:
        graph, self.graph = self.graph, None
        if graph is None:
            return
        try:
            recorded = end_capture(graph)
        except RuntimeError as exc:
            abandon_capture(None)
            if at != "the end of the forward":
                at = f"{at} at {self._line()}"
            raise CaptureFailed(
                f"piecewise [capture_illegal]: the CUDA graph from {self.where} to {at} cannot be closed: {exc}. "
                f"The usual cause is a side stream forked in that stretch (stream.wait_stream(...) then work on "
                f"it) and not joined back before {at}: join it (torch.cuda.current_stream().wait_stream(side)) "
                f"before the splitting op, or fork it inside the splitting op."
            ) from exc
        if recorded:
            graph.replay()  # the splitting op after this graph reads what it computed
            self.recording.steps.append(graph)

    def _abort(self) -> None:
        graph, self.graph = self.graph, None
        if graph is not None:
            abandon_capture(graph)

    # --- ops --------------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kinds = self.frontend.kinds
        kind = kinds.get(func)
        if kind is None:
            kind = kinds[func] = _kind(func, self.frontend.splitting)
        if kind is _PLAIN:
            return func(*args, **kwargs)
        if kind is _SPLIT:
            return self._split(func, func._schema.name, args, kwargs)
        if kind is _WRITES:
            written = _written(func, args, kwargs)
            static = [t for t in written if _storage(t) in self.frontend.static]
            if static and func.overloadpacket.__name__ in ACCUMULATING_METHODS:
                raise ForwardRefused(
                    f"piecewise: `{func.overloadpacket.__name__}` at {self._line()} updates a static tensor in place "
                    f"from its own value. The first call runs the model several times on its inputs (warm-up, "
                    f"then one run per capture size), so the update would be applied more than once. Move it into "
                    f"a splitting op (piecewise.opaque_op(..., split=True)) that skips it while "
                    f"piecewise.context().rehearsal is True, or keep the state out of forward.",
                    "state_update", user_chain(),
                )
            if any(self.frontend.stager.owns(t) for t in written):
                raise ForwardRefused(
                    f"piecewise: `{func.overloadpacket.__name__}` at {self._line()} writes in place into a token "
                    f"argument. Token arguments are copied into padded buffers on every call, so the write would be "
                    f"lost: compile with dynamic={{...}} naming only the real token arguments.",
                    "token_argument_write", user_chain(),
                )
            if static and self.rows != self.size and self._token_leaves(tree_flatten((args, kwargs))[0]):
                return self._split(func, func._schema.name, args, kwargs)
        elif kind is _SYNCS and self.graph is not None:
            self._abort()
            raise CaptureFailed(
                f"piecewise [capture_illegal]: `{func.overloadpacket.__name__}` at {self._line()} waits for the "
                f"device (its result goes to the host: .item(), .tolist(), bool(tensor), nonzero), which is "
                f"illegal while a CUDA graph captures; a branch on a tensor's value cannot be frozen into a graph "
                f"either. Keep the value on the device (torch.where, masks), compute it before forward, or move "
                f"the code into a splitting op (piecewise.opaque_op(..., split=True)).",
                chain=user_chain(),
            )
        return func(*args, **kwargs)

    def _line(self) -> str:
        return chain_text(user_chain()[-1:]) or "an unknown line"

    def _token_leaves(self, leaves: list) -> list[int]:
        static = self.frontend.static
        return [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
                and leaf.shape[0] == self.size and _storage(leaf) not in static]

    def _split(self, func, name: str, args: tuple, kwargs: dict) -> Any:
        self.frontend.state.splitting_op_calls += 1
        where = f"`{name}`"
        if self.recording is not None:
            self._end(at=where)
        leaves, spec = tree_flatten((args, kwargs))
        token_leaves = self._token_leaves(leaves)
        written = {id(t) for t in _written(func, args, kwargs)}
        zero_after = [i for i in token_leaves if id(leaves[i]) in written]
        info = opaque_op_info(name)
        call = info.impl if info is not None and info.impl is not None else func
        if self.rows == self.size:
            call_args, call_kwargs = args, kwargs
        else:
            sliced = list(leaves)
            for index in token_leaves:
                sliced[index] = sliced[index][: self.rows]
            call_args, call_kwargs = tree_unflatten(sliced, spec)
        if self.frontend.state.probe is not None and name in self.frontend.splitting:
            probe_call(self.frontend.state, call_args, call_kwargs)
        # Inside __torch_dispatch__ the mode is off: the op's own ops are not the forward's.
        ctx = context()
        with forward_context(self.rows, self.size, capturing=False, rehearsal=bool(ctx and ctx.rehearsal)):
            result = call(*call_args, **call_kwargs)
        for index in zero_after:
            if self.rows != self.size:
                leaves[index][self.rows : self.size].zero_()
        staged, buffers, single = self._stage(result, args, bool(token_leaves))
        if self.recording is not None:
            self.recording.steps.append(_Step(call, leaves, spec, token_leaves, zero_after, buffers, single,
                                              name in self.frontend.splitting))
        self.calls += 1
        self.where = where
        self._begin()
        return staged

    def _stage(self, result: Any, args: tuple, has_tokens: bool) -> tuple[Any, list, bool]:
        """Copy a splitting op's token outputs into static buffers (rows past the real ones zero); return what
        the forward sees: ``size`` rows of each buffer."""
        if result is None:
            return None, [], True
        single = isinstance(result, torch.Tensor)
        values = [result] if single else list(result)
        buffers: list[RowBuffer | None] = []
        staged = []
        for output, value in enumerate(values):
            is_token = (has_tokens and isinstance(value, torch.Tensor) and value.dim() > 0
                        and value.shape[0] == self.rows and not any(value is a for a in args))
            if not is_token:
                buffers.append(None)
                staged.append(value)
                continue
            buffer = self.frontend.buffer(self.calls, output, value)
            buffer.write(value, self.rows)
            buffers.append(buffer)
            staged.append(buffer.rows(self.size))
        return (staged[0] if single else type(result)(staged)), buffers, single


_PLAIN, _SPLIT, _WRITES, _SYNCS = "plain", "split", "writes", "syncs"


def _kind(func, splitting: frozenset[str]) -> str:
    name = func._schema.name
    if name in splitting:
        return _SPLIT
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return _WRITES
    return _SYNCS if name in _HOST_SYNC else _PLAIN


_WRITTEN: dict[Any, list[tuple[int, str]]] = {}


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (its schema's mutable arguments)."""
    positions = _WRITTEN.get(func)
    if positions is None:
        positions = _WRITTEN[func] = [
            (i, a.name) for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        ]
    found = []
    for index, name in positions:
        value = args[index] if index < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found
