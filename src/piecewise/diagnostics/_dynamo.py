"""Every private Dynamo API the diagnostics read, in one place, accessed defensively.

Dynamo's exception attributes (``real_stack``, ``gb_type``, ``innermost_user_frame_summary``), the result
of ``torch._dynamo.explain`` and FX node metadata differ between torch releases. The rest of the package
only calls the functions here, so a torch upgrade touches this file alone. Checked on torch 2.13; the
attributes used exist since 2.11, and each has a fallback (parsing the exception text) when missing.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from piecewise.graph.stack import node_stack, normalise_frame, parse_stack_text

__all__ = ["node_stack", "parse_stack_text"]

logger = logging.getLogger(__name__)

# Dynamo names the graph input that carries a hoisted Python ``random`` call ``random_value_<n>``.
_RANDOM_VALUE_PREFIX = "random_value_"


@dataclass
class BreakReason:
    """One graph break as ``torch._dynamo.explain`` reports it."""

    reason: str
    stack: list[traceback.FrameSummary]


@dataclass
class ExplainResult:
    """The parts of ``torch._dynamo.explain``'s output the diagnostics use."""

    breaks: list[BreakReason] = field(default_factory=list)
    graphs: list[torch.fx.GraphModule] = field(default_factory=list)


def reset() -> None:
    """Forget every compiled frame (``torch._dynamo.explain`` does the same before and after it runs)."""
    torch._dynamo.reset()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence Dynamo's graph-break warnings while the doctor provokes graph breaks on purpose."""
    dynamo_logger = logging.getLogger("torch._dynamo")
    previous = dynamo_logger.level
    dynamo_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        dynamo_logger.setLevel(previous)


def is_dynamo_exception(exc: BaseException) -> bool:
    """True for exceptions raised by Dynamo's tracer (unsupported code, user errors, fake-tensor failures)."""
    exc_module = type(exc).__module__ or ""
    return exc_module.startswith("torch._dynamo") or hasattr(exc, "real_stack") or hasattr(exc, "gb_type")


def gb_type(exc: BaseException) -> str | None:
    """Dynamo's short graph-break type (``"Attempted to call function marked as skipped"``), when it has one."""
    value = getattr(exc, "gb_type", None)
    return value if isinstance(value, str) and value else None


def exception_text(exc: BaseException) -> str:
    """The exception's own message: ``msg`` on Dynamo exceptions (no traceback appended), else ``str``."""
    message = getattr(exc, "msg", None)
    return message if isinstance(message, str) and message else str(exc)


def exception_stack(exc: BaseException) -> list[traceback.FrameSummary]:
    """User-code frames from the traced function down to the failing line, outermost first.

    ``real_stack`` when Dynamo set it; else the ``from user code:`` section of the message; else the single
    ``innermost_user_frame_summary``; else an empty list.
    """
    stack = getattr(exc, "real_stack", None)
    if stack:
        return [normalise_frame(frame) for frame in stack]
    parsed = parse_stack_text(str(exc).partition("from user code:")[2])
    if parsed:
        return parsed
    innermost = getattr(exc, "innermost_user_frame_summary", None)
    if isinstance(innermost, traceback.FrameSummary):
        return [normalise_frame(innermost)]
    return []




def explain(fn: Callable, args: tuple, kwargs: dict) -> ExplainResult:
    """Run ``torch._dynamo.explain(fn)(*args, **kwargs)`` (fullgraph=False) and normalise its result.

    Dynamo's explain resets every compiled frame before and after it runs.
    """
    output = torch._dynamo.explain(fn)(*args, **kwargs)
    breaks = []
    for entry in getattr(output, "break_reasons", None) or []:
        reason = getattr(entry, "reason", None) or str(entry)
        stack = [normalise_frame(frame) for frame in (getattr(entry, "user_stack", None) or [])]
        breaks.append(BreakReason(reason=reason, stack=stack))
    graphs = [graph for graph in (getattr(output, "graphs", None) or []) if isinstance(graph, torch.fx.GraphModule)]
    return ExplainResult(breaks=breaks, graphs=graphs)


def fullgraph_error(fn: Callable, args: tuple, kwargs: dict) -> BaseException | None:
    """Trace ``fn`` as the runtime does (``fullgraph=True``) with a do-nothing backend; the error, if any.

    This finds blockers ``explain`` does not report: ``explain`` records a break only with the graph
    compiled just before it, so a break before any tensor op, or one that makes Dynamo skip the whole frame
    (an unsupported context manager), leaves no trace there.
    """

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        return graph_module.forward

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    try:
        compiled(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any tracing failure is a finding
        return exc
    finally:
        reset()
    return None


def is_python_random_input(node: torch.fx.Node) -> bool:
    """True for a graph input that Dynamo made from a hoisted Python ``random`` call."""
    return node.op == "placeholder" and str(node.name).startswith(_RANDOM_VALUE_PREFIX)
