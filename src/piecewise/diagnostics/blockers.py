"""Capture blockers: what stops a forward from being traced into one graph, where, and how to fix it.

A :class:`Blocker` holds a stable ``kind`` (see ``FIXES`` for the list), Dynamo's reason shortened to what
matters, the call chain from the model's forward down to the offending line, and a concrete remedy.
``find_blockers`` lists every blocker of a function; ``blockers_from_exception`` turns the one error of a
``fullgraph=True`` trace into blockers; ``CaptureBlockedError`` is what the runtime raises with them.
"""

from __future__ import annotations

import contextlib

import inspect
import linecache
import logging
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from piecewise import _compat
from piecewise.diagnostics import _dynamo
from piecewise.diagnostics.classify import FIXES, KINDS, analyse
from piecewise.diagnostics.jit_fix import jit_fix
from piecewise.errors import CaptureBlockedError
from piecewise.graph.writes import accumulates, describe_write, writes_to_inputs

logger = logging.getLogger(__name__)

__all__ = [
    "FIXES",
    "KINDS",
    "Blocker",
    "CaptureBlockedError",
    "Frame",
    "blockers_from_exception",
    "find_blockers",
]

# FX call_method targets that copy a tensor to the host: Dynamo traces them without a graph break.
_HOST_COPY_METHODS = frozenset({"cpu", "numpy", "tolist", "item"})


@dataclass(frozen=True)
class Frame:
    """One frame of a call chain: ``file:line in function`` and the source line."""

    file: str
    line: int
    function: str
    code: str | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"

    @classmethod
    def from_summary(cls, summary: traceback.FrameSummary) -> "Frame":
        code = summary.line or linecache.getline(summary.filename, summary.lineno or 0)
        return cls(summary.filename, int(summary.lineno or 0), summary.name, code.strip() or None)


@dataclass
class Blocker:
    """Something in forward that stops capture: its kind, Dynamo's reason, the call chain and the fix.

    ``chain`` runs from the model's forward (first) to the line that calls the blocked thing (last);
    frames inside torch and the stdlib below that line are left out.
    """

    kind: str
    message: str
    chain: list[Frame] = field(default_factory=list)
    fix: str = ""

    @property
    def location(self) -> Frame | None:
        """The innermost frame: the offending line."""
        return self.chain[-1] if self.chain else None

    def format(self) -> str:
        """Plain-text rendering: kind and message, the chain one frame per line, then the fix."""
        lines = [f"[{self.kind}] {self.message}"]
        if self.chain:
            lines.append("  call chain (forward first):")
            for frame in self.chain:
                lines.append(f"    {frame}")
                if frame.code:
                    lines.append(f"        {frame.code}")
        lines.append("  fix: " + self.fix.replace("\n", "\n       "))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "chain": [
                {"file": frame.file, "line": frame.line, "function": frame.function, "code": frame.code}
                for frame in self.chain
            ],
            "fix": self.fix,
        }


TRANSFORMERS_HINT = (
    "\nIn a Hugging Face transformers model: piecewise.integrations.transformers.enable(model) routes its "
    "attention and MoE experts through capture-safe ops (transformers' grouped_mm experts kept, its eager "
    "expert loop replaced), and TokenModel(model) gives the token-major call piecewise pads."
)


def _blocker(
    reason: str,
    gb: str | None,
    stack: list[traceback.FrameSummary],
    root_file: str | None,
    kind: str | None = None,
) -> Blocker:
    finding = analyse(reason, gb, stack)
    if kind is not None:
        finding.kind = kind
    fix = jit_fix(finding.frames, root_file) if finding.kind == "jit_subprocess" else FIXES[finding.kind]
    if any(f"{os.sep}transformers{os.sep}models{os.sep}" in frame.filename for frame in finding.frames):
        fix += TRANSFORMERS_HINT
    return Blocker(
        kind=finding.kind,
        message=finding.message,
        chain=[Frame.from_summary(frame) for frame in finding.frames],
        fix=fix,
    )


def blockers_from_exception(exc: BaseException, *, root_file: str | None = None) -> list[Blocker]:
    """Blockers from the error of ``torch.compile(..., fullgraph=True)`` (Dynamo stops at the first one).

    ``root_file`` is the model's source file: frames outside it (and its package) are library code, and
    the fix for ``jit_subprocess`` names the outermost such function. Default: the chain's first file.
    """
    if isinstance(exc, CaptureBlockedError):
        return list(exc.blockers)
    stack = _dynamo.exception_stack(exc)
    if not stack and exc.__traceback__ is not None and not _dynamo.is_dynamo_exception(exc):
        stack = traceback.extract_tb(exc.__traceback__)
    reason = _dynamo.exception_text(exc)
    if not _dynamo.is_dynamo_exception(exc):
        reason = f"{type(exc).__name__}: {reason}"
    return [_blocker(reason, _dynamo.gb_type(exc), stack, root_file)]


def _source_file(fn: Callable) -> str | None:
    target = getattr(fn, "forward", fn)
    try:
        return inspect.getsourcefile(inspect.unwrap(target))
    except (TypeError, OSError):
        return None


def _graph_blockers(graphs: list[torch.fx.GraphModule], root_file: str | None) -> list[Blocker]:
    """Hazards Dynamo traces without a graph break: host copies, hoisted Python RNG values, and state
    updated in place from its own value."""
    found = []
    for graph_module in graphs:
        inputs = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
        for writer, placeholder in writes_to_inputs(graph_module, inputs):
            if accumulates(writer):
                reason = (
                    f"{describe_write(writer)} updates {_compat.argument_source(placeholder)} in place from its "
                    f"own value\n  Explanation: the first piecewise call runs the model several times on its "
                    f"inputs, so the update would be applied more than once."
                )
                found.append(_blocker(reason, None, _dynamo.node_stack(writer), root_file, kind="state_update"))
        for node in graph_module.graph.nodes:
            if node.op == "call_method" and node.target in _HOST_COPY_METHODS:
                reason = (
                    f"Tensor.{node.target}() copies to the host\n  Explanation: a device-to-host copy "
                    f"synchronises with the GPU, which is illegal while a CUDA graph captures."
                )
                found.append(_blocker(reason, None, _dynamo.node_stack(node), root_file, kind="host_sync"))
            elif _dynamo.is_python_random_input(node):
                users = list(node.users)
                stack = _dynamo.node_stack(users[0]) if users else []
                reason = (
                    "Python random value\n  Explanation: Dynamo draws it on the host before the graph runs and "
                    "feeds it in as an input, so torch's generators do not control it."
                )
                found.append(_blocker(reason, None, stack, root_file, kind="python_rng"))
    return found


def _dedupe(blockers: list[Blocker]) -> list[Blocker]:
    seen: set[tuple[str, str | None]] = set()
    unique = []
    for blocker in blockers:
        key = (blocker.kind, str(blocker.location) if blocker.location else blocker.message)
        if key not in seen:
            seen.add(key)
            unique.append(blocker)
    return unique


def _forward_order(blockers: list[Blocker], root_file: str | None) -> list[Blocker]:
    """Blockers in the order of their line in the root file (then discovery order)."""

    root = os.path.realpath(root_file) if root_file else None

    def key(blocker: Blocker) -> tuple[int, int]:
        in_root = [frame.line for frame in blocker.chain if root and os.path.realpath(frame.file) == root]
        return (0, in_root[0]) if in_root else (1, 0)

    return sorted(blockers, key=key)


_MEMO: list[dict] = []  # while the doctor runs (``remembered``): blockers by forward and input kinds


@contextlib.contextmanager
def remembered() -> Iterator[None]:
    """Within the block, ``find_blockers`` of the same forward on inputs of the same kinds is found once: the doctor's
    own trace and its trial first calls (each front-end it tries) ask for the same list."""
    _MEMO.append({})
    try:
        yield
    finally:
        _MEMO.pop()


def _memo_key(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    function = getattr(fn, "__func__", fn)
    function = getattr(function, "__wrapped__", function)  # a runner's private copy of the forward
    kinds = tuple((type(v).__name__, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v)[:64]
                  for v in (*args, *kwargs.values()))
    return getattr(function, "__code__", function), id(getattr(fn, "__self__", None)), tuple(kwargs), kinds


def find_blockers(fn: Callable, args: tuple = (), kwargs: dict | None = None) -> list[Blocker]:
    """Every capture blocker of ``fn(*args, **kwargs)``, in forward order, without duplicates (found once per forward
    and input kinds inside ``remembered``).

    Runs ``torch._dynamo.explain`` (graph breaks do not stop it, so it sees past the first blocker), scans
    the graphs it produced for host copies and Python RNG inputs Dynamo traces without breaking, then
    traces once with ``fullgraph=True`` as the runtime does, which catches breaks ``explain`` cannot
    attribute (e.g. an unsupported context manager). ``fn`` runs (partly eagerly) during this. Like
    ``explain``, this resets Dynamo's compiled-frame caches: later ``torch.compile`` calls start afresh.
    """
    return list(_find_memoised(fn, args, kwargs)[0])


def traced_regions(fn: Callable, args: tuple = (), kwargs: dict | None = None) -> int | None:
    """How many graphs Dynamo traced of ``fn(*args, **kwargs)`` with graph breaks allowed (the regions Inductor
    compiles under ``frontend="breakable", compiler="inductor"``), or None where ``explain`` failed. Found with the
    blockers (``find_blockers``), once while the doctor runs."""
    return _find_memoised(fn, args, kwargs)[1]


def _find_memoised(fn: Callable, args: tuple, kwargs: dict | None) -> tuple[list[Blocker], int | None]:
    kwargs = dict(kwargs or {})
    key = _memo_key(fn, args, kwargs) if _MEMO else None
    if key is not None and key in _MEMO[-1]:
        return _MEMO[-1][key]
    found = _find_blockers(fn, args, kwargs)
    if key is not None:
        _MEMO[-1][key] = found
    return found


def _find_blockers(fn: Callable, args: tuple, kwargs: dict) -> tuple[list[Blocker], int | None]:
    root_file = _source_file(fn)
    blockers: list[Blocker] = []
    regions = None
    with _dynamo.quiet():
        try:
            result = _dynamo.explain(fn, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - explain stops at some internal errors: report them
            logger.debug("torch._dynamo.explain raised %s", type(exc).__name__, exc_info=True)
            blockers.extend(blockers_from_exception(exc, root_file=root_file))
        else:
            regions = len(result.graphs)
            for entry in result.breaks:
                blockers.append(_blocker(entry.reason, None, entry.stack, root_file))
            blockers.extend(_graph_blockers(result.graphs, root_file))
        error = _dynamo.fullgraph_error(fn, args, kwargs)
        if error is not None:
            blockers.extend(blockers_from_exception(error, root_file=root_file))
    return _forward_order(_dedupe(blockers), root_file), regions
