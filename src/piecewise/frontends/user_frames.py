"""The model's own frames of the running Python stack (what a user must read in a message)."""

from __future__ import annotations

import linecache
import os
import traceback

from ..diagnostics.classify import is_stdlib, is_torch_internal

_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
# piecewise's own machinery; its bundled models (models/) and integrations are model code a user reads.
_MACHINERY = tuple(_PACKAGE + part for part in ("capture", "frontends", "runtime", "graph", "diagnostics", "context.py",
                                                 "opaque.py", "diagnose.py"))


def user_chain() -> list[traceback.FrameSummary]:
    """Frames of the current stack outside torch, the standard library and piecewise's machinery, outermost
    first (the model's forward down to the line running now)."""
    frames = []
    for frame in traceback.extract_stack()[:-1]:
        path = os.path.realpath(frame.filename)
        if path.startswith(_MACHINERY) or is_torch_internal(path) or is_stdlib(path) or "<" in frame.filename:
            continue
        frames.append(frame)
    return frames


def chain_text(frames: list[traceback.FrameSummary]) -> str:
    """``file:line (`code`)`` for each frame, innermost last, joined by `` -> ``."""
    parts = []
    for frame in frames:
        code = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        parts.append(f"{frame.filename}:{frame.lineno}" + (f" (`{code}`)" if code else ""))
    return " -> ".join(parts)
