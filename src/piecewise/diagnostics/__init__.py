"""Diagnostics: find what stops a model from being captured, and say how to fix it.

``find_blockers`` and ``blockers_from_exception`` give the :class:`Blocker` list; the runtime raises
:class:`CaptureBlockedError` with the same blockers when a strict capture fails. ``piecewise.doctor`` (on top
of the runtime) runs every check and returns a ``DoctorReport``.
"""

from piecewise.errors import CaptureBlockedError
from piecewise.diagnostics.blockers import (
    FIXES,
    KINDS,
    Blocker,
    Frame,
    blockers_from_exception,
    find_blockers,
)

__all__ = [
    "FIXES",
    "KINDS",
    "Blocker",
    "CaptureBlockedError",
    "Frame",
    "blockers_from_exception",
    "find_blockers",
]
