"""piecewise: piecewise CUDA graphs for PyTorch inference models.

Trace the model once, cut the graph at ops that must run eagerly (attention, all-reduce, untraceable
code), compile each piece, capture each piece as a CUDA graph per token count, replay with padding.
"""

from .config import CaptureConfig
from .context import ForwardContext, context
from .diagnostics import Blocker, CaptureBlockedError, DoctorReport, doctor
from .opaque import opaque_op, wrap_opaque
from .runtime import PiecewiseModel, compile

__all__ = [
    "Blocker",
    "CaptureBlockedError",
    "DoctorReport",
    "doctor",
    "CaptureConfig",
    "ForwardContext",
    "PiecewiseModel",
    "compile",
    "context",
    "opaque_op",
    "wrap_opaque",
]

__version__ = "0.1.0"
