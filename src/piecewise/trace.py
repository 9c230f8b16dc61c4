"""Trace the model's forward with Dynamo, once, with the token dimension symbolic.

``fullgraph=True`` first. If Dynamo cannot trace something, ``strict=True`` raises
``CaptureBlockedError`` (what, where, how to fix); the default lists every blocker once as a warning and
traces again with graph breaks allowed: each untraceable region then runs eagerly between captured pieces.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import _compat

logger = logging.getLogger(__name__)


class ForwardTracer:
    """Calls the Dynamo-compiled forward; handles the first trace's failure modes."""

    def __init__(self, model: torch.nn.Module, backend: Callable, strict: bool):
        self.model = model
        self.backend = backend
        self.strict = strict
        self.compiled = torch.compile(
            _compat.fresh_method(model.forward), backend=backend, fullgraph=True, dynamic=False,
            options=_compat.compile_options(),
        )
        self.graph_breaks = False
        self.blockers: list[Any] = []
        self.first_trace_done = False

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        try:
            if self.first_trace_done:
                return self.compiled(*args, **kwargs)
            with _compat.tracing_patches():
                try:
                    output = self.compiled(*args, **kwargs)
                except _compat.Unsupported as exc:
                    output = self._trace_with_breaks(exc, args, kwargs)
        except _compat.BackendCompilerFailed as exc:
            inner = getattr(exc, "inner_exception", None)
            if isinstance(inner, ValueError):  # piecewise's own message for the user: no Dynamo wrapping
                raise inner from None
            raise
        self.first_trace_done = True
        return output

    def _trace_with_breaks(self, exc: Exception, args: tuple, kwargs: dict) -> Any:
        from .diagnostics import CaptureBlockedError, blockers_from_exception, find_blockers

        blockers = find_blockers(_compat.fresh_method(self.model.forward), args, kwargs)
        if not blockers:
            blockers = blockers_from_exception(exc)
        if self.strict:
            raise CaptureBlockedError(blockers) from None
        for blocker in blockers:
            warnings.warn(
                "piecewise: this region cannot be traced and runs eagerly between captured pieces "
                "(strict=False):\n" + blocker.format(),
                stacklevel=4,
            )
        self.blockers = blockers
        self.graph_breaks = True
        # dynamic=None: code after a break gets tensors Python made, which carry no dynamic mark; Dynamo
        # traces it once static, then once more with the dimensions that changed made dynamic.
        self.compiled = torch.compile(
            _compat.fresh_method(self.model.forward), backend=self.backend, fullgraph=False, dynamic=None,
            options=_compat.compile_options(),
        )
        return self.compiled(*args, **kwargs)
