"""Where an FX node or a traceback came from: user frames, outermost first (read from FX metadata and text)."""

from __future__ import annotations

import re
import traceback
from typing import Any

import torch

# Functions Dynamo generates to resume a frame after a graph break: ``torch_dynamo_resume_in_<fn>_at_<line>``.
_RESUME_NAME = re.compile(r"^(?:torch_dynamo_resume_in_|__resume_at_)(?P<name>.+?)_at_\d+$")
_FRAME_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+?)\s*$')


def parse_stack_text(text: str) -> list[traceback.FrameSummary]:
    """Frames from text in Python's traceback format (``File "f.py", line 3, in fn`` + source line)."""
    frames: list[traceback.FrameSummary] = []
    lines = text.splitlines()
    for index, line in enumerate(lines):
        match = _FRAME_LINE.match(line)
        if match is None:
            continue
        source = lines[index + 1].strip() if index + 1 < len(lines) else ""
        if _FRAME_LINE.match(source) or set(source) <= {"^", "~", " "}:
            source = ""
        frames.append(
            normalise_frame(
                traceback.FrameSummary(
                    match["file"], int(match["line"]), match["name"], lookup_line=False, line=source or None
                )
            )
        )
    return frames


def normalise_frame(frame: Any) -> traceback.FrameSummary:
    """A FrameSummary with Dynamo's resume-function names mapped back to the user's function name."""
    name = getattr(frame, "name", "?")
    match = _RESUME_NAME.match(name)
    if match is None and isinstance(frame, traceback.FrameSummary):
        return frame
    return traceback.FrameSummary(
        getattr(frame, "filename", "?"),
        getattr(frame, "lineno", 0) or 0,
        match["name"] if match else name,
        lookup_line=False,
        line=getattr(frame, "line", None),
    )


def node_stack(node: torch.fx.Node) -> list[traceback.FrameSummary]:
    """User frames that produced an FX node (from ``node.meta["stack_trace"]``), outermost first."""
    text = node.meta.get("stack_trace") if hasattr(node, "meta") else None
    return parse_stack_text(text) if isinstance(text, str) else []
