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
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..capture.buffers import InputStager, RowBuffer
from ..capture.pieces import abandon_capture, end_capture
from ..capture.state import CaptureState, Phase, probe_call
from .breakable_steps import Recording, Step, narrow, signature, storage, token_outputs, written as _written
from ..capture.stats import Stats
from ..config import CaptureConfig
from ..context import context, forward_context
from ..errors import CaptureFailed, ForwardRefused, FullGraphRefused
from ..graph.writes import ACCUMULATING_METHODS
from ..opaque import captured_whole, opaque_op_info, resolve_splitting_ops
from .user_frames import chain_text, user_chain

logger = logging.getLogger(__name__)

# Ops that wait for the device (their result goes to the host): illegal while a CUDA graph captures. ``item`` is
# seen undecomposed on some torch versions (2.11), ``_local_scalar_dense`` on others.
_HOST_SYNC = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::equal", "aten::is_nonzero",
})


class BreakableFrontend:
    """Runs the model's Python per size under capture; replays the recorded graphs and calls."""

    name = "breakable"

    def __init__(self, model: torch.nn.Module, config: CaptureConfig, state: CaptureState, stats: Stats,
                 stager: InputStager):
        self.model = model
        self.state = state
        self.stats = stats
        self.stager = stager
        self.splitting = resolve_splitting_ops(config.splitting_ops)
        self.static = state.static_storages  # the model's parameters and buffers, static arguments (late ones too)
        self.recordings: dict[int, Recording] = {}
        self.buffers: dict[tuple[int, int], RowBuffer] = {}  # (call index in the forward, output) → buffer
        self.fixed: dict[tuple[int, int], torch.Tensor] = {}  # the same for outputs without token rows
        self.token_outputs: dict = {}  # (op, input shapes) → which outputs carry the token rows
        self.token_dims: dict[tuple, int] = {}  # (op, argument, its rank) → its token dimension in cut writes
        self.warned_signature = False
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
            if recording is not None and recording.signature != signature(arguments):
                self._warn_signature(recording.signature, signature(arguments))
                recording = None  # the graphs were recorded for other arguments: run padded, without them
            if recording is not None:
                output = recording.replay(call.num_tokens, self.state)
                self.state.replays += recording.graphs
                self.stats.replays += recording.graphs
                self.state.splitting_op_calls = len(recording.steps) - recording.graphs
                return output
        capturing = call.phase is Phase.CAPTURE and self.graphs_allowed
        recording = Recording(call.size, signature(arguments)) if capturing else None
        with _Interceptor(self, call.num_tokens, call.size, recording) as interceptor:
            output = interceptor.forward(arguments)
        if recording is not None:
            recording.output = output
            recording.keep = self._keeps
            self.recordings[call.size] = recording
            self.state.captured_this_size.append(recording)
        self.stats.pieces = max(self.stats.pieces, interceptor.calls + 1)
        return output

    def _warn_signature(self, captured: tuple, now: tuple) -> None:
        if self.warned_signature:
            return
        self.warned_signature = True
        was, isnow = dict(captured), dict(now)
        changes = "; ".join(f"argument {name!r}: {was.get(name)} -> {isnow.get(name)}"
                            for name in sorted(set(was) | set(isnow)) if was.get(name) != isnow.get(name))
        warnings.warn(
            f"piecewise: the model is called with other arguments than its graphs were captured for ({changes}); "
            f"such calls run without CUDA graphs. Call the model with the arguments it was captured with, or "
            f"compile a separate runner for this variant.", stacklevel=6)

    def _keeps(self, tensor: torch.Tensor) -> bool:
        """Whether a recorded tensor lives outside the graph pool (static, staged or a splitting-op buffer)."""
        pointer = storage(tensor)
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
            self.buffer_storages.add(storage(buffer.buffer))
        return buffer

    def fixed_buffer(self, index: int, output: int, value: torch.Tensor) -> torch.Tensor:
        key = (index, output)
        buffer = self.fixed.get(key)
        if buffer is None or buffer.dtype != value.dtype or buffer.shape != value.shape:
            buffer = self.fixed[key] = torch.empty_like(value, memory_format=torch.contiguous_format)
            self.buffer_storages.add(storage(buffer))
        return buffer


class _Interceptor(TorchDispatchMode):
    """The forward of one padded call: splitting ops on the real rows, graphs cut around them when capturing."""

    def __init__(self, frontend: BreakableFrontend, rows: int, size: int, recording: Recording | None):
        super().__init__()
        self.frontend, self.rows, self.size, self.recording = frontend, rows, size, recording
        self.full = frontend.state.call.full
        self.kinds = frontend.kinds
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
            abandon_capture(None, self.frontend.state)
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
            abandon_capture(graph, self.frontend.state)

    # --- ops --------------------------------------------------------------------------------------------

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No Dynamo-disabling wrapper around ``__torch_dispatch__``: it runs for every op of every size's forward,
        # a sixth to a fifth of what the mode adds to it. (torch.compile'd code inside a splitting op runs compiled
        # either way: a compiled function sets its own frame callback.)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self.kinds.get(func)
        if kind is _PLAIN:  # most ops: nothing to decide
            return func(*args, **kwargs) if kwargs else func(*args)
        if kind is None:
            kind = self.kinds[func] = _kind(func, self.frontend.splitting)
            if kind is _PLAIN:
                return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        if kind is _SPLIT:
            if self.full:  # inside a full graph: on the padded rows (the op reads the token mask)
                return self._inline(func, args, kwargs)
            return self._split(func, func._schema.name, args, kwargs, cut=False)
        if kind is _COPIES and self.graph is not None and _to_host(func, args, kwargs):
            self._refuse_sync(func)
        if kind is _WRITES:
            written = _written(func, args, kwargs)
            if self.graph is not None and func._schema.name == "aten::copy_" and _to_host(func, args, kwargs):
                self._refuse_sync(func)
            static = [t for t in written if storage(t) in self.frontend.static]
            if static and _accumulates(func, args, kwargs):
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
            # Cut out while padded (the pad rows would be written too) and whenever capturing: the graph of this
            # size serves later calls with fewer tokens.
            if static and (self.rows != self.size or self.recording is not None or self.full) \
                    and self._token_leaves(tree_flatten((args, kwargs))[0], True, func._schema.name):
                if self.full:
                    raise FullGraphRefused(f"`{func.overloadpacket.__name__}` at {self._line()} writes token rows "
                                           f"into a static tensor outside a splitting op")
                return self._split(func, func._schema.name, args, kwargs, cut=True)
        elif kind is _SYNCS and self.graph is not None:
            self._refuse_sync(func)
        return func(*args, **kwargs)

    def _inline(self, func, args: tuple, kwargs: dict) -> Any:
        if not captured_whole(func._schema.name):
            raise FullGraphRefused(f"`{func._schema.name}` at {self._line()} cannot run inside a full graph")
        return func(*args, **kwargs)

    def _refuse_sync(self, func) -> None:
        self._abort()
        raise CaptureFailed(
            f"piecewise [capture_illegal]: `{func.overloadpacket.__name__}` at {self._line()} waits for the "
            f"device (its result goes to the host: .item(), .tolist(), .cpu(), bool(tensor), nonzero), which is "
            f"illegal while a CUDA graph captures; a branch on a tensor's value cannot be frozen into a graph "
            f"either. Keep the value on the device (torch.where, masks), compute it before forward, or move "
            f"the code into a splitting op (piecewise.opaque_op(..., split=True)).",
            chain=user_chain(),
        )

    def _line(self) -> str:
        return chain_text(user_chain()[-1:]) or "an unknown line"

    def _token_leaves(self, leaves: list, any_dim: bool, op: str = "") -> list[tuple[int, int]]:
        """(leaf, token dimension) of the tensors that carry the call's padded rows: as long as the capture size
        in dimension 0 (splitting ops take tokens first), or in any dimension for a write cut out of a graph (a
        [batch, heads, tokens, dim] cache write), other than the model's static tensors."""
        static, size, known = self.frontend.static, self.size, self.frontend.token_dims
        found = []
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and storage(leaf) not in static:
                dims = [d for d, extent in enumerate(leaf.shape) if extent == size] if any_dim else \
                    [0] if leaf.shape[0] == size else []
                key = (op, index, leaf.dim())
                if len(dims) > 1:  # [heads, tokens, dim] at a size equal to heads: as at a size that told
                    dims = [known[key]] if key in known else dims[:1]
                elif dims and any_dim:
                    known[key] = dims[0]
                if dims:
                    found.append((index, dims[0]))
        return found

    def _split(self, func, name: str, args: tuple, kwargs: dict, cut: bool) -> Any:
        self.frontend.state.splitting_op_calls += 1
        where = f"`{name}`"
        if self.recording is not None:
            self._end(at=where)
        leaves, spec = tree_flatten((args, kwargs))
        tokens = self._token_leaves(leaves, cut, name)
        written = {id(t) for t in _written(func, args, kwargs)}
        zero_after = [(i, d) for i, d in tokens if id(leaves[i]) in written]
        info = opaque_op_info(name)
        call = info.impl if info is not None and info.impl is not None else func
        if self.rows == self.size:
            call_args, call_kwargs = args, kwargs
        else:
            sliced = list(leaves)
            for index, dim in tokens:
                sliced[index] = narrow(sliced[index], dim, self.rows)
            call_args, call_kwargs = tree_unflatten(sliced, spec)
        if self.frontend.state.probe is not None and name in self.frontend.splitting:
            probe_call(self.frontend.state, call_args, call_kwargs)
        # Inside __torch_dispatch__ the mode is off: the op's own ops are not the forward's.
        ctx = context()
        with forward_context(self.rows, self.size, capturing=False, rehearsal=bool(ctx and ctx.rehearsal)):
            result = call(*call_args, **call_kwargs)
        if self.rows != self.size:
            for index, dim in zero_after:
                leaves[index].narrow(dim, self.rows, self.size - self.rows).zero_()
        staged, buffers, single = self._stage(func, result, leaves, call_args, call_kwargs, tokens)
        if self.recording is not None:
            self.recording.steps.append(Step(call, leaves, spec, tokens, zero_after, buffers, single,
                                             name in self.frontend.splitting))
        self.calls += 1
        self.where = where
        del result  # copied into the buffers: freed now, not inside the next capture (where a free is deferred)
        self._begin()
        return staged

    def _stage(self, func, result: Any, leaves: list, call_args: tuple, call_kwargs: dict,
               tokens: list) -> tuple[Any, list, bool]:
        """What the forward sees of a splitting op's outputs: ``size`` rows of a static buffer for each token
        output (rows past the real ones zero), a fixed buffer for each other tensor (the graphs after the op read
        it at one address), an argument the op returned as it is."""
        if result is None:
            return None, [], True
        single = isinstance(result, torch.Tensor)
        values = [result] if single else list(result)
        real = self.rows
        which = token_outputs(func, call_args, call_kwargs, [(i, d) for i, d in tokens], real, values,
                              self.frontend.token_outputs) if tokens else [False] * len(values)
        if which is None:  # no fake to ask: dimension 0 as long as the real rows
            which = [isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == real for v in values]
        buffers: list = []
        staged = []
        for output, value in enumerate(values):
            if not isinstance(value, torch.Tensor) or any(value is leaf for leaf in leaves):
                buffers.append(None)
                staged.append(value)
            elif which[output]:
                buffer = self.frontend.buffer(self.calls, output, value)
                buffer.write(value, real)
                buffers.append(buffer)
                staged.append(buffer.rows(self.size))
            else:
                buffer = self.frontend.fixed_buffer(self.calls, output, value)
                buffer.copy_(value)
                buffers.append(buffer)
                staged.append(buffer)
        return (staged[0] if single else type(result)(staged)), buffers, single


_PLAIN, _SPLIT, _WRITES, _SYNCS, _COPIES = "plain", "split", "writes", "syncs", "copies"
# In-place methods that read what they overwrite, less those that only change a view (t_, squeeze_, ...).
_UPDATES = ACCUMULATING_METHODS - {"t_", "transpose_", "squeeze_", "unsqueeze_", "resize_"}


def _accumulates(func, args: tuple, kwargs: dict) -> bool:
    """Whether an in-place op reads what it overwrites (``add_``, ``index_put_(accumulate=True)``,
    ``scatter_(reduce=...)``): run again on the same inputs, it gives another result."""
    name = func.overloadpacket.__name__
    if name in _UPDATES:
        return True
    if name in ("index_put_", "_index_put_impl_"):
        return bool(kwargs.get("accumulate", args[3] if len(args) > 3 else False))
    if name == "scatter_":
        return kwargs.get("reduce", args[4] if len(args) > 4 else None) is not None
    return False


def _to_host(func, args: tuple, kwargs: dict) -> bool:
    """A copy from the device to the host (``.cpu()``, ``.to("cpu")``, ``cpu_tensor.copy_(cuda_tensor)``)."""
    if func._schema.name == "aten::copy_":
        return len(args) > 1 and args[0].device.type == "cpu" and args[1].device.type != "cpu"
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"


def _kind(func, splitting: frozenset[str]) -> str:
    name = func._schema.name
    if name in splitting:
        return _SPLIT
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return _WRITES
    if name == "aten::_to_copy":
        return _COPIES
    return _SYNCS if name in _HOST_SYNC else _PLAIN


