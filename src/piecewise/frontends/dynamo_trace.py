"""Trace the model's forward with Dynamo, once, with the token dimension symbolic.

``fullgraph=True`` first. If Dynamo cannot trace something, ``strict=True`` raises
``CaptureBlockedError`` (what, where, how to fix); the default lists every blocker once as a warning and
traces again with graph breaks allowed: each untraceable region then runs eagerly between captured pieces.

After the one full-graph trace, calls skip Dynamo's frame hook (``DirectCall``): Dynamo's own guard check,
then its transformed bytecode called as a plain function. A failing guard goes back through Dynamo.
"""

from __future__ import annotations

import inspect
import logging
import traceback
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from ..capture.state import STATE_CHANGE
from ..diagnostics.blockers import blockers_from_exception, find_blockers
from ..errors import CaptureBlockedError, CaptureFailed, ForwardRefused, StateChanged, first_line

logger = logging.getLogger(__name__)


def fresh_method(method: types.MethodType) -> types.MethodType:
    """A copy of a bound method with its own code object.

    Dynamo caches compiled frames on the code object; a private copy keeps each compiled model's cache
    apart (no recompile-limit fallbacks when many models of one class are compiled, no cross-talk).
    """
    function = getattr(method, "__func__", None)
    if not isinstance(function, types.FunctionType):
        return method
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__module__ = function.__module__
    copy.__wrapped__ = function
    return types.MethodType(copy, method.__self__)


class DirectCall:
    """The compiled forward without Dynamo's per-call frame machinery.

    Dynamo's hook around a compiled frame costs far more than its guard check (on the 16-layer decode model,
    on a CPU: ~350 µs per call against ~12 µs), which matters when the rest of a step is CUDA-graph replays.
    This runs the same guard check, then the same transformed bytecode (which gathers the graph inputs, calls
    the backend's runner, rebuilds the output and replays side effects).
    """

    def __init__(self, method: types.MethodType, code: types.CodeType, check):
        function = method.__func__
        self.owner = method.__self__
        self.check = check
        self.function = types.FunctionType(
            code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
        )
        self.function.__kwdefaults__ = function.__kwdefaults__
        self.self_name = code.co_varnames[0]
        own = function.__code__
        named = own.co_argcount + own.co_kwonlyargcount
        self.named = frozenset(own.co_varnames[1:named])
        self.varkw = own.co_varnames[named] if own.co_flags & inspect.CO_VARKEYWORDS else None
        """``forward(..., **arguments)`` (the runtime's ``TokensFirst``): the frame holds the keywords that are not
        named parameters as one dict, under that name."""
        self.broken = False
        self.cells = tuple(zip(function.__code__.co_freevars, function.__closure__ or ()))
        self.defaults = {
            name: p.default
            for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty
        }

    @classmethod
    def build(cls, method: types.MethodType) -> DirectCall | None:
        function = getattr(method, "__func__", None)
        if not isinstance(function, types.FunctionType):
            return None
        entry = _compat.compiled_entry(function.__code__)
        if entry is None:
            return None
        code, check = entry
        if code.co_freevars != function.__code__.co_freevars or code.co_argcount != function.__code__.co_argcount:
            return None
        if function.__code__.co_flags & inspect.CO_VARARGS:
            return None
        return cls(method, code, check)

    def frame_locals(self, kwargs: dict) -> dict:
        """What Dynamo's guards see of a call with ``kwargs``."""
        if self.varkw:
            given = {name: value for name, value in kwargs.items() if name in self.named}
            given[self.varkw] = {name: value for name, value in kwargs.items() if name not in self.named}
        else:
            given = kwargs
        frame_locals = {**self.defaults, **given, self.self_name: self.owner}
        for name, cell in self.cells:  # Dynamo's guards see closure variables as frame locals
            frame_locals[name] = cell.cell_contents
        return frame_locals

    def __call__(self, kwargs: dict) -> tuple[bool, Any]:
        frame_locals = self.frame_locals(kwargs)
        try:
            passed = self.check(frame_locals)
        except Exception as exc:  # a torch whose guard check wants more than the frame's locals
            logger.warning("piecewise: Dynamo's guard check cannot be called directly (%s); calls go through Dynamo", exc)
            self.broken = True
            return False, None
        if not passed:
            return False, None
        return True, self.function(self.owner, **kwargs)


def soften(arguments: dict) -> None:
    """Soft token-dimension marks on the arguments (see ``_compat.soften_token_dims``): for traces with breaks."""
    for value in arguments.values():
        if isinstance(value, torch.Tensor):
            _compat.soften_token_dims(value)


class DynamoBlocked(Exception):
    """Dynamo cannot trace the forward as one graph (``frontend="auto"`` then takes the breakable front-end)."""

    def __init__(self, blockers: list[Any]):
        super().__init__(f"{len(blockers)} Dynamo blocker(s)")
        self.blockers = blockers


def state_guard_refusal(method: Any) -> ForwardRefused:
    """The error for a forward whose Python state fails Dynamo's guards on every call (a list the forward appends
    to, a counter): named with the guard and the model line, when Dynamo recorded them."""
    guard, frame = _compat.last_guard_failure(method) or (None, None)
    return ForwardRefused(
        "piecewise: the forward's Python state changes from call to call"
        + (f" (the guard that failed: `{guard}`)" if guard else "") + ", so Dynamo would trace it again on every "
        "call. Keep that state out of forward, or use CaptureConfig(frontend='breakable'), which runs the "
        "forward's Python as written.",
        "state_guard", [traceback.FrameSummary(*frame)] if frame else [],
    )


def trace_failure(exc: Exception, describe_change: Callable[[], str], preparing: bool, method: Any) -> Exception | None:
    """What a failed trace raises to the runtime, or None for ``exc`` as it is. Past the first call nothing of the
    forward ran when Dynamo's recompile limit is hit, a trace fails on the call's padded rows (a per-token tensor read
    from a global, sized at a one-token first call) or the backend refuses it (a branch on the count): the
    ``StateChanged`` it becomes sends the call to the model's own forward."""
    if isinstance(exc, _compat.RECOMPILE_LIMIT):
        change = describe_change()
        if change == STATE_CHANGE:
            return state_guard_refusal(method)
        if not preparing:
            return StateChanged(f"the model was traced again for calls like this one until Dynamo's recompile limit "
                                f"({change})")
        return ValueError(f"piecewise: the model was traced again until Dynamo's recompile limit ({change}): call it "
                          f"with the argument types and Python values it was captured with, or compile a separate "
                          f"runner for each variant")
    if preparing or (isinstance(exc, ForwardRefused) and not getattr(exc, "at_trace", False)):
        return None
    return StateChanged(f"the model was traced again after the first call ({describe_change()}) and that trace cannot "
                        f"serve padded calls ({first_line(exc, 200)})")


class _QuietRecompileLimit(logging.Filter):
    """Drops Dynamo's log line for a recompile limit hit while a traced call runs: piecewise serves such calls with
    the model's own forward and warns once per kind of change itself (Dynamo logs it on every call)."""

    active = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.active and isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config."))


_quiet = _QuietRecompileLimit()
logging.getLogger("torch._dynamo.convert_frame").addFilter(_quiet)


class ForwardTracer:
    """Calls the Dynamo-compiled forward; handles the first trace's failure modes.

    ``on_blocker``: ``"raise"`` (strict: ``CaptureBlockedError``), ``"break"`` (graph breaks, one warning per
    blocker) or ``"report"`` (``DynamoBlocked``, for the automatic choice of front-end)."""

    def __init__(self, model: torch.nn.Module, backend: Callable, on_blocker: str):
        self.model = model
        self.backend = backend
        self.on_blocker = on_blocker
        self.method = fresh_method(model.forward)
        self.compiled = torch.compile(
            self.method, backend=backend, fullgraph=True, dynamic=False, options=_compat.compile_options()
        )
        self.graph_breaks = False
        self.blockers: list[Any] = []
        self.first_trace_done = False
        self.diagnose_kwargs: dict | None = None
        """What ``find_blockers`` runs the forward on after a failed first trace: the call's real rows. Its
        explain pass runs the model without piecewise, so padded rows would reach ops that write state (a KV
        cache at the pad rows' positions)."""
        self.direct: DirectCall | None = None
        self.last_direct = False
        """Whether the last call skipped Dynamo's frame hook."""

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        """Run the forward through Dynamo (the first call traces; later ones skip Dynamo's frame hook)."""
        self.last_direct = False
        if self.direct is not None and not args:
            done, output = self.direct(kwargs)
            if done:
                self.last_direct = True
                return output
            if self.direct.broken:
                self.direct = None
        try:
            with _compat.tracing_patches(), warnings.catch_warnings():  # retraces too: sizes 0/1 stay unspecialised
                # Dynamo's own warnings about what it traces into (a cached function, an unknown builtin) are
                # about code piecewise reports itself, as blockers with their fix.
                warnings.filterwarnings("ignore", message=r"Dynamo (detected|does not know)", category=UserWarning)
                if self.first_trace_done:
                    _quiet.active = True
                    try:
                        return self.compiled(*args, **kwargs)
                    finally:
                        _quiet.active = False
                try:
                    output = self.compiled(*args, **kwargs)
                except _compat.UNTRACEABLE as exc:
                    output = self._trace_with_breaks(exc, args, kwargs)
        except _compat.BackendCompilerFailed as exc:
            inner = getattr(exc, "inner_exception", None)
            if isinstance(inner, (ForwardRefused, CaptureFailed)):  # piecewise's own message: no Dynamo wrapping
                inner.at_trace = True  # raised by the backend, while Dynamo traced: nothing of the forward ran
                raise inner from None
            raise
        self.first_trace_done = True
        if not self.graph_breaks:
            self.direct = DirectCall.build(self.method)
        return output

    def _trace_with_breaks(self, exc: Exception, args: tuple, kwargs: dict) -> Any:
        diagnose = self.diagnose_kwargs if self.diagnose_kwargs is not None else kwargs
        blockers = find_blockers(fresh_method(self.model.forward), args, diagnose)
        if not blockers:
            blockers = blockers_from_exception(exc)
        if self.on_blocker == "raise":
            raise CaptureBlockedError(blockers) from None
        if self.on_blocker == "report":
            raise DynamoBlocked(blockers) from None
        for blocker in blockers:
            warnings.warn(
                "piecewise: this region cannot be traced and runs eagerly between captured pieces "
                "(strict=False):\n" + blocker.format(),
                stacklevel=4,
            )
        self.blockers = blockers
        self.graph_breaks = True
        soften(kwargs)
        # dynamic=None: code after a break gets tensors Python made, which carry no dynamic mark; Dynamo
        # traces it once static, then once more with the dimensions that changed made dynamic.
        self.compiled = torch.compile(
            fresh_method(self.model.forward), backend=self.backend, fullgraph=False, dynamic=None,
            options=_compat.compile_options(graph_breaks=True),
        )
        try:
            return self.compiled(*args, **kwargs)
        except (ForwardRefused, CaptureFailed, _compat.BackendCompilerFailed):
            raise  # piecewise's own refusals (the caller unwraps them)
        except Exception as failure:  # noqa: BLE001 - Dynamo failing inside the model: the blockers instead
            first = str(failure).strip().splitlines()[0] if str(failure).strip() else ""
            raise CaptureBlockedError(blockers, headline=(
                f"the forward cannot be traced, even with graph breaks (Dynamo raised {type(failure).__name__}"
                f"{': ' + first if first else ''}). Fix the blocker(s) below, each with its call chain and fix "
                f"(piecewise.doctor(model, *args) checks a model the same way)."
            )) from None
