"""Diagnostics: find what stops a model from being captured, and say how to fix it.

``doctor(model, *args)`` runs every check and returns a :class:`DoctorReport`; ``find_blockers`` and
``blockers_from_exception`` give the :class:`Blocker` list directly; the runtime raises
:class:`CaptureBlockedError` with the same blockers when a strict capture fails.
"""

from piecewise.diagnostics.blockers import (
    FIXES,
    KINDS,
    Blocker,
    CaptureBlockedError,
    Frame,
    blockers_from_exception,
    find_blockers,
)
from piecewise.diagnostics.doctor import DoctorReport, doctor

__all__ = [
    "FIXES",
    "KINDS",
    "Blocker",
    "CaptureBlockedError",
    "DoctorReport",
    "Frame",
    "blockers_from_exception",
    "doctor",
    "find_blockers",
]
