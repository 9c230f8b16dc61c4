"""piecewise: piecewise CUDA graphs for PyTorch inference models.

Run the model's forward once per token count under capture, cut it at ops that must run eagerly
(attention, all-reduce, untraceable code), capture the rest as CUDA graphs for a ladder of token counts,
and replay them with padding.

The public names load on first use, so ``piecewise --help`` and usage errors do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Light modules (no torch import) are bound now: a later import of the submodule piecewise.context would
# otherwise shadow the function of the same name.
from .config import CaptureConfig
from .context import ForwardContext, context, redirect_padding

_EXPORTS = {
    "Blocker": "piecewise.diagnostics",
    "CaptureBlockedError": "piecewise.errors",
    "VerificationError": "piecewise.errors",
    "VerifyReport": "piecewise.runtime.verify",
    "DoctorReport": "piecewise.diagnose",
    "doctor": "piecewise.diagnose",
    "opaque_op": "piecewise.opaque",
    "wrap_opaque": "piecewise.opaque",
    "PiecewiseModel": "piecewise.runtime",
    "compile": "piecewise.runtime",
    "generate": "piecewise.generation",
    "generate_stream": "piecewise.generation",
}

__all__ = sorted([*_EXPORTS, "CaptureConfig", "ForwardContext", "context", "redirect_padding"])
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .diagnostics import Blocker
    from .diagnose import DoctorReport, doctor
    from .errors import CaptureBlockedError, VerificationError
    from .runtime.verify import VerifyReport
    from .opaque import opaque_op, wrap_opaque
    from .runtime import PiecewiseModel, compile
    from .generation import generate, generate_stream


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'piecewise' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
