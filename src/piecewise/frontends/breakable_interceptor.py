"""The breakable front-end's view of one run of the forward: a ``TorchDispatchMode`` that sees every op.

- a splitting op (``opaque_op(..., split=True)`` or ``CaptureConfig.splitting_ops``) ends the current graph
  segment, runs on the real rows (its ``SplitCall``) and the next segment begins;
- an in-place write into a static tensor (a KV cache) that takes token rows is cut out the same way, so it runs
  on the real rows only (inside a graph it would also write the padding rows, at position 0);
- refused, naming the model's line: an update of state from its own value, a write into a token argument, and a
  wait for the device (``.item()``, ``.cpu()``, ``nonzero``) while capturing, where it is illegal; outside a capture
  (a CPU run, a padded run) a floating-point value read on the host is refused too, since on a padded call it would
  come from the padding rows as well (integer and boolean reads, such as a check on the positions, are metadata that
  capture-aware code skips while capturing);
- each op is logged with its Python arguments (``OpLog``) while the first call compares runs;
- in a survey run (unpadded, ``Survey``) each call site's inputs and outputs are observed instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import _compat
from ..capture.buffers import InputStager
from ..capture.segment import Segment
from ..capture.splitcall import Roles, SplitCall
from ..capture.state import CaptureState
from ..context import context, forward_context
from ..errors import CaptureFailed, ForwardRefused, FullGraphRefused
from ..graph.writes import ACCUMULATING_METHODS
from ..opaque import captured_whole, opaque_op_info
from .breakable_outside import OutsideTensors, refuse_python_values
from .breakable_regions import inside_region, watching_regions
from .breakable_steps import Recording, Step, storage, written_indices, written_tensors
from .breakable_survey import Observed, OpLog, offsets, shapes
from .user_frames import current_line as _line, user_chain


_CONSTRUCTED = (torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy, torch.ops.aten.lift)
"""Ops that take a tensor the forward just built from Python data (``torch.tensor([...])``): made by the run,
though no op made it. An empty one (transformers' cache layers start so) holds no value; any other is refused
(``refuse_python_values``)."""

class Owner(Protocol):
    """What the interceptor reads of the breakable front-end that runs it."""

    model: torch.nn.Module
    state: CaptureState
    stager: InputStager
    splitting: frozenset[str]
    static: set[int]
    """Storages of the model's parameters and buffers and of its static arguments."""
    kinds: dict[Any, str]
    """Op overload → what the interceptor does with it (``_kind``), decided once per op."""
    module_storages: set[int] | None
    """Storages of the model's tensors, for ``OutsideTensors`` (None: not walked yet)."""
    op_watch: Any  # the captures' watch of custom ops' reads (``runtime.op_reads.Watch``), or None

    def split_call(self, key: tuple, func: Any, call: Any, leaves: list, spec: Any, cut: bool) -> SplitCall: ...

    def call_forward(self, arguments: dict[str, Any]) -> Any: ...

# Ops that wait for the device (their result goes to the host). ``item`` is seen undecomposed on some torch
# versions (2.11), ``_local_scalar_dense`` on others. Those of ``_SHAPE_FROM_DATA`` also size their output by the
# data: on a padded call, by the padding rows too.
_HOST_SYNC = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::equal", "aten::is_nonzero",
})
_SHAPE_FROM_DATA = frozenset({"aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim",
                              "aten::unique_consecutive"})
_PLAIN, _SPLIT, _WRITES, _SYNCS, _COPIES, _MASKED = "plain", "split", "writes", "syncs", "copies", "masked"
# In-place methods that read what they overwrite, less those that only change a view (t_, squeeze_, ...).
_UPDATES = ACCUMULATING_METHODS - {"t_", "transpose_", "squeeze_", "unsqueeze_", "resize_"}


class Interceptor(TorchDispatchMode):
    """One run of the forward at ``size`` padded rows (``rows`` real): splitting ops on the real rows, graph
    segments around them when ``recording``."""

    def __init__(self, frontend: Owner, rows: int, size: int, recording: Recording | None,
                 log: OpLog | None, survey: dict[tuple, Observed] | None):
        super().__init__()
        self.frontend, self.rows, self.size, self.recording = frontend, rows, size, recording
        self.state = frontend.state
        self.full = self.state.call.full
        self.kinds = frontend.kinds
        self.log, self.survey = log, survey
        self.segment: Segment | None = None
        self.quiet = False
        """Set while a segment begins or ends: torch's own ops then (the generators' capture bookkeeping) are not the
        forward's."""
        self.calls = 0
        self.occurrences: dict[tuple, int] = {}
        self.where = "the start of the forward"
        self.outside: OutsideTensors | None = None
        """While the first call's runs are checked: what the forward may read (``breakable_outside``)."""
        self.watch = frontend.op_watch  # while capturing: each op through ``op_reads.Watch.run``, not a second mode

    def forward(self, arguments: dict[str, Any]) -> Any:
        if self.log is not None:
            self.outside = OutsideTensors(self.frontend, arguments)
        self._begin()
        try:
            with watching_regions(self.outside), _compat.conds_as_branches():
                output = self.frontend.call_forward(arguments)
        except BaseException as exc:
            capturing = self.segment is not None
            self._abort()
            if capturing and isinstance(exc, RuntimeError) and not isinstance(exc, CaptureFailed) \
                    and "captur" in str(exc):  # torch refused a CUDA call while the stream captured
                raise CaptureFailed(
                    f"piecewise [capture_illegal]: the CUDA graph from {self.where} could not record what the forward "
                    f"did next ({exc}). Work on a stream or event piecewise does not see (torch.Stream, torch.Event), "
                    f"a wait for the host or an allocation outside the pool is illegal while a graph captures: join "
                    f"side streams through torch.cuda.Stream.wait_stream, or move the code into a splitting op.",
                    chain=user_chain()) from exc
            raise
        self._end(at="the end of the forward")
        return output

    # --- graph segments ---------------------------------------------------------------------------------

    def _begin(self) -> None:
        if self.recording is not None:
            self.segment = Segment(self.state)
            self.quiet = True
            try:
                self.segment.begin()
            finally:
                self.quiet = False

    def _end(self, at: str) -> None:
        segment, self.segment = self.segment, None
        if segment is None:
            return
        self.quiet = True
        try:
            recorded = segment.end()
        except RuntimeError as exc:
            if at != "the end of the forward":
                at = f"{at} at {_line()}"
            raise CaptureFailed(
                f"piecewise [capture_illegal]: the CUDA graph from {self.where} to {at} cannot be closed: {exc}. "
                f"Side streams forked with wait_stream are joined at the splitting op; this one was forked another "
                f"way (an event piecewise did not see) or waits for the host: join it "
                f"(torch.cuda.current_stream().wait_stream(side)) before the splitting op, or fork it inside the op.",
                chain=user_chain(),
            ) from exc
        finally:
            self.quiet = False
        if recorded:
            segment.replay()  # the splitting op after this segment reads what it computed
            self.recording.steps.append(segment)

    def _abort(self) -> None:
        segment, self.segment = self.segment, None
        if segment is not None:
            self.quiet = True
            try:
                segment.abandon()
            finally:
                self.quiet = False

    # --- ops --------------------------------------------------------------------------------------------

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No Dynamo-disabling wrapper around ``__torch_dispatch__`` (a fifth of the mode's cost per op); compiled
        # code inside a splitting op sets its own frame callback and runs compiled either way.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.quiet:
            return func(*args, **(kwargs or {}))
        if self.outside is None or inside_region():
            return self._dispatch(func, args, kwargs)
        if func.overloadpacket not in _CONSTRUCTED:
            self.outside.check(f"`{func.overloadpacket.__name__}`", args, kwargs)
        elif any(isinstance(a, torch.Tensor) and a.numel() > 0 for a in args):
            refuse_python_values(args[0])
        result = self._dispatch(func, args, kwargs)
        self.outside.made(result)
        return result

    def _dispatch(self, func, args: tuple, kwargs: dict | None) -> Any:
        kind = self.kinds.get(func)
        if kind is None:
            kind = self.kinds[func] = _kind(func, self.frontend.splitting)
        if self.log is not None and not inside_region():
            self.log.add(func, args, kwargs)
        if kind is _PLAIN and self.watch is None:  # most ops: nothing to decide
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        if kind is _PLAIN:
            return self.watch.run(func, args, kwargs)
        if kind is _SPLIT:
            if self.full:  # inside a full graph: on the padded rows (the op reads the token mask)
                return self._inline(func, args, kwargs)
            return self._split(func, args, kwargs, cut=False)
        if kind is _MASKED and _masked(args):  # x[mask]: sized by the mask's values
            self._refuse_sync(func)
        if kind is _SYNCS or (kind is _COPIES and _to_host(func, args, kwargs)):
            if self.segment is not None or _floating(args) or func._schema.name in _SHAPE_FROM_DATA:
                self._refuse_sync(func)
            if self.log is not None:
                self.log.stop()
        if kind is _WRITES:
            return self._write(func, args, kwargs)
        return self.run_op(func, args, kwargs)

    def run_op(self, func, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs) if self.watch is None else self.watch.run(func, args, kwargs)

    def _write(self, func, args: tuple, kwargs: dict) -> Any:
        written = written_tensors(func, args, kwargs)
        if func._schema.name == "aten::copy_" and _to_host(func, args, kwargs) and \
                (self.segment is not None or _floating(args[1:])):
            self._refuse_sync(func)
        static = [t for t in written if storage(t) in self.frontend.static]
        if static and _accumulates(func, args, kwargs):
            raise ForwardRefused(
                f"piecewise: `{func.overloadpacket.__name__}` at {_line()} updates a static tensor in place from its "
                f"own value. The first call runs the model several times on its inputs (warm-up, then one run per "
                f"capture size), so the update would be applied more than once. Move it into a splitting op "
                f"(piecewise.opaque_op(..., split=True)) that skips it while piecewise.context().rehearsal is True, "
                f"or keep the state out of forward.",
                "state_update", user_chain(),
            )
        if any(self.frontend.stager.owns(t) for t in written):
            raise ForwardRefused(
                f"piecewise: `{func.overloadpacket.__name__}` at {_line()} writes in place into a token argument. "
                f"Token arguments are copied into padded buffers on every call, so the write would be lost. State "
                f"kept across calls: compile with dynamic={{...}} naming only the real token arguments; tokens (a "
                f"pipeline stage's hidden states): write into a copy (`x = x.clone()` first) and return it.",
                "token_argument_write", user_chain(),
            )
        if not static:
            return self.run_op(func, args, kwargs)
        key = self._key("write", func._schema.name)
        if self.survey is not None:
            return self._observe(key, func, args, kwargs)
        # Cut out while padded (the pad rows would be written too) and whenever capturing: the graph of this size
        # serves later calls with fewer tokens.
        if self.rows != self.size or self.recording is not None or self.full:
            leaves, spec = tree_flatten((args, kwargs))
            split = self.frontend.split_call(key, func, func, leaves, spec, cut=True)
            if split.takes_tokens(leaves, self.size):
                if self.full and self.rows != self.size:
                    raise FullGraphRefused(f"`{func.overloadpacket.__name__}` at {_line()} writes token rows into a "
                                           f"static tensor outside a splitting op")
                if self.full:  # no pad row: the write is exact inside the graph (``CaptureState.full_exact``)
                    self.state.full_exact = True
                    return self.run_op(func, args, kwargs)
                return self._run_split(split, leaves, f"`{func._schema.name}`")
        return self.run_op(func, args, kwargs)

    def _key(self, kind: str, name: str) -> tuple:  # the call site: kind, op, which call of it in this run
        count = self.occurrences.get((kind, name), 0)
        self.occurrences[(kind, name)] = count + 1
        return kind, name, count

    def _observe(self, key: tuple, call, args: tuple, kwargs: dict) -> Any:
        """A survey run: run the op as it is and note the shapes of its inputs and outputs."""
        result = call(*args, **kwargs)
        leaves = tree_flatten((args, kwargs))[0]
        outputs = [result] if isinstance(result, torch.Tensor) or result is None else list(result)
        self.survey[key] = Observed(shapes(leaves), shapes(outputs), _line(), offsets(leaves))
        return result

    def _inline(self, func, args: tuple, kwargs: dict) -> Any:
        if not captured_whole(func._schema.name):
            raise FullGraphRefused(f"`{func._schema.name}` at {_line()} cannot run inside a full graph")
        return self.run_op(func, args, kwargs)

    def _refuse_sync(self, func) -> None:
        self._abort()
        raise CaptureFailed(
            f"piecewise [capture_illegal]: `{func.overloadpacket.__name__}` at {_line()} waits for the device (its "
            f"result goes to the host: .item(), .tolist(), .cpu(), bool(tensor), nonzero) outside a splitting op. "
            f"That is illegal while a CUDA graph captures, a graph cannot keep a branch on a tensor's value, and on a "
            f"padded call the value would come from the padding rows too. Keep the value on the device (torch.where, "
            f"masks), compute it before forward, or move the code into a splitting op "
            f"(piecewise.opaque_op(..., split=True)), which runs on the real rows.",
            chain=user_chain(),
        )

    def _split(self, func, args: tuple, kwargs: dict, cut: bool) -> Any:
        name = func._schema.name
        key = self._key("split", name)
        info = opaque_op_info(name)
        call = info.impl if info is not None and info.impl is not None else func
        if self.survey is not None:
            self.state.splitting_op_calls += 1
            ctx = context()
            with forward_context(self.rows, self.size, rehearsal=bool(ctx and ctx.rehearsal)):
                return self._observe(key, call, args, kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        split = self.frontend.split_call(key, func, call, leaves, spec, cut=cut)
        return self._run_split(split, leaves, f"`{name}`")

    def _run_split(self, split: SplitCall, leaves: list, where: str) -> Any:
        self.state.splitting_op_calls += 1
        if self.recording is not None:
            self._end(at=where)
        # Inside __torch_dispatch__ the mode is off: the op's own ops are not the forward's.
        ctx = context()
        with forward_context(self.rows, self.size, rehearsal=bool(ctx and ctx.rehearsal)):
            staged = split.run(leaves, self.state.call)
        if self.recording is not None:
            self.recording.steps.append(Step(split, leaves))
        self.calls += 1
        self.where = where
        self._begin()
        return staged


class CompiledInterceptor(Interceptor):
    """The interceptor over a forward with compiled regions: torch.compile'd code runs compiled under it (Dynamo
    runs everything eagerly under a dispatch mode that does not ignore compiled internals), and it sees the ops
    the compiled code calls through the dispatcher: splitting ops, cut writes, extern kernels."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    # Called from the forward's eager stretches, which run under torch.compile's frame callback: Dynamo would try
    # to compile ``__torch_dispatch__`` itself, once per op. (A torch.compile'd function inside a splitting op sets
    # its own frame callback and runs compiled.)
    __torch_dispatch__ = torch.compiler.disable(Interceptor.__torch_dispatch__, recursive=True)


def new_split_call(frontend: Owner, key: tuple, func, call, leaves: list, spec, cut: bool,
                   roles: Roles | None) -> SplitCall:
    """The ``SplitCall`` of a call site first seen: its roles from the survey, or by shape where it had none."""
    written = written_indices(func, leaves, spec)
    body = _body(call, spec)
    probed = not cut and key[1] in frontend.splitting
    if roles is None:
        return SplitCall(key[1], body, Roles(written=written), frontend.state, probed=probed, cut=cut, by_shape=True,
                         any_dim=cut)
    return SplitCall(key[1], body, dataclasses.replace(roles, written=written), frontend.state, probed=probed, cut=cut)


def _body(call, spec):
    def body(leaves):
        args, kwargs = tree_unflatten(list(leaves), spec)
        return call(*args, **kwargs)

    return body



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


def _masked(args: tuple) -> bool:
    """``aten::index`` with a boolean index (``x[mask]``): its output has as many rows as the mask has True values."""
    return len(args) > 1 and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


def _floating(args: tuple) -> bool:  # whether the tensor an op reads back to the host holds floating point
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()


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
    if name == "aten::index":
        return _MASKED
    return _SYNCS if name in _HOST_SYNC else _PLAIN

