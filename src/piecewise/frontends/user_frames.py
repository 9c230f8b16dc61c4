"""The model's own frames of the running Python stack (what a user must read in a message)."""

from __future__ import annotations

import linecache
import os
import sys
import traceback

from ..diagnostics.classify import is_stdlib, is_torch_internal

_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
# piecewise's own machinery; its bundled models (models/) and integrations are model code a user reads.
_MACHINERY = tuple(_PACKAGE + part for part in ("capture", "frontends", "runtime", "graph", "diagnostics", "context.py",
                                                 "opaque.py", "diagnose.py", "_compat.py", "cli", "bench.py",
                                                 "generation.py", "__main__.py"))
_CONSOLE_SCRIPT = os.path.realpath(sys.argv[0]) if os.path.basename(sys.argv[0] or "") == "piecewise" else None
"""The ``piecewise`` command's own launcher, whose frame heads every stack the CLI runs."""


def user_chain() -> list[traceback.FrameSummary]:
    """Frames of the current stack outside torch, the standard library and piecewise's machinery, outermost
    first (the model's forward down to the line running now)."""
    frames = []
    for frame in traceback.extract_stack()[:-1]:
        path = os.path.realpath(frame.filename)
        if path.startswith(_MACHINERY) or is_torch_internal(path) or is_stdlib(path) or "<" in frame.filename \
                or path == _CONSOLE_SCRIPT:
            continue
        frames.append(frame)
    return frames


_USER_FILES: dict[str, bool] = {}


def _user_file(filename: str) -> bool:
    user = _USER_FILES.get(filename)
    if user is None:
        path = os.path.realpath(filename)
        user = _USER_FILES[filename] = not (path.startswith(_MACHINERY) or is_torch_internal(path) or is_stdlib(path)
                                            or "<" in filename)
    return user


is_user_file = _user_file
"""Whether a file is the model's (not torch's, the standard library's or piecewise's machinery)."""


def current_line() -> str:
    """``file:line (`code`)`` of the innermost model frame running now, or "an unknown line" (for messages)."""
    return chain_text(user_chain()[-1:]) or "an unknown line"


def innermost_user_line() -> tuple[str, int] | None:
    """(file, line) of the innermost model frame running now: ``user_chain()[-1]`` for every op of a run, cheaply."""
    frame = innermost_user_frame()
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def innermost_user_frame():
    """The innermost model frame running now (its globals are where a model keeps its own state), or None."""
    frame = sys._getframe(1)
    while frame is not None:
        if _user_file(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return None


def caller_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, from the function that calls this, for the innermost frame outside the
    piecewise package: the user's call into it."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.realpath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def line_text(place: tuple[str, int] | None) -> str:
    """``file:line (`code`)``, or "an unknown line"."""
    if place is None:
        return "an unknown line"
    code = linecache.getline(place[0], place[1]).strip()
    return f"{place[0]}:{place[1]}" + (f" (`{code}`)" if code else "")


def chain_text(frames: list[traceback.FrameSummary]) -> str:
    """``file:line (`code`)`` for each frame, innermost last, joined by `` -> ``."""
    parts = []
    for frame in frames:
        code = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        parts.append(f"{frame.filename}:{frame.lineno}" + (f" (`{code}`)" if code else ""))
    return " -> ".join(parts)
