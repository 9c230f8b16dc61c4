"""Every exception a user of piecewise can meet, and the blocker kinds they carry."""

from __future__ import annotations

import enum
import traceback
from typing import Any


class BlockerKind(str, enum.Enum):
    """What stops a forward from being captured. A ``str`` enum: ``BlockerKind.HOST_SYNC == "host_sync"``."""

    JIT_SUBPROCESS = "jit_subprocess"
    HOST_SYNC = "host_sync"
    DATA_DEPENDENT_SHAPE = "data_dependent_shape"
    COMPILER_DISABLED = "compiler_disabled"
    PYTHON_RNG = "python_rng"
    LOGGING = "logging"
    UNSUPPORTED_CONTEXT_MANAGER = "unsupported_context_manager"
    UNSUPPORTED_BUILTIN = "unsupported_builtin"
    CAPTURE_ILLEGAL = "capture_illegal"
    STATE_UPDATE = "state_update"
    TOKEN_MIXING = "token_mixing"
    TOKEN_BRANCH = "token_branch"
    STATE_GUARD = "state_guard"
    TOKEN_ARGUMENT_WRITE = "token_argument_write"
    BATCH_FIRST = "batch_first"
    TOKEN_LAYOUT = "token_layout"
    FROZEN_VALUE = "frozen_value"
    SIDE_STREAM = "side_stream"
    FOREIGN_REGION = "foreign_region"
    OUTPUT_OBJECT = "output_object"
    MODULE_HOOK = "module_hook"
    TRANSFORMERS_CACHE = "transformers_cache"

    def __str__(self) -> str:
        return self.value


def first_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: the message's first line`` (cut to ``limit``), for a message that quotes another error."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:limit] if lines else ''}"


class ForwardRefused(ValueError):
    """A forward piecewise cannot run correctly with padding and repeated first-call runs. ``kind`` is the
    doctor's blocker kind; ``chain`` the model frames involved, forward first."""

    def __init__(self, message: str, kind: str, chain: list[traceback.FrameSummary] | None = None):
        super().__init__(message)
        self.kind = BlockerKind(kind)
        self.chain = list(chain or [])


class CaptureFailed(RuntimeError):
    """An operation is illegal during CUDA-graph capture. ``node`` is the FX node (Dynamo front-end) and
    ``chain`` the model frames (breakable front-end) where it happened, when known."""

    def __init__(self, message: str, node: Any = None, chain: list[traceback.FrameSummary] | None = None):
        super().__init__(message)
        self.node = node
        self.chain = list(chain or [])


class StateChanged(RuntimeError):
    """A call after the first whose model state (a Python attribute the trace read, a flag) differs from what the
    graphs were made for: the runtime runs the model's own forward for it, with one warning (the message)."""


class CaptureOutOfMemory(RuntimeError):
    """The device ran out of memory while the first call captured its graphs: the message says at which size, what
    was captured by then and what to lower. Nothing is left half-captured (the runner can be compiled again)."""


class CaptureBlockedError(RuntimeError):
    """The forward cannot be captured; ``.blockers`` lists why, where, and how to fix each."""

    def __init__(self, blockers: list[Any], headline: str | None = None) -> None:
        self.blockers = list(blockers)
        head = headline or (
            f"the forward cannot be captured into CUDA graphs: {len(self.blockers)} blocker(s), each with its "
            f"call chain and fix below (piecewise.doctor(model, *args) checks a model the same way)."
        )
        super().__init__("\n\n".join([head, *(blocker.format() for blocker in self.blockers)]))


class VerificationError(RuntimeError):
    """``CaptureConfig(verify=...)`` found a captured size whose results differ from eager; ``.report`` says
    which sizes, by how much, and where the forward parts from eager."""

    def __init__(self, report: Any):
        self.report = report
        super().__init__(f"piecewise: the captured graphs differ from eager:\n{report}")


class FullGraphRefused(RuntimeError):
    """The forward cannot run inside one full graph (``CaptureConfig.graph_mode``): the runner turns full graphs
    off for the model, says why, and runs every call piecewise."""


class FakeMismatch(ValueError):
    """An opaque op's ``fake`` describes other outputs than the op returns (seen at the op's first eager call):
    Dynamo would trace the rest of the forward for the fake's shapes. The message names the op, both and the fix."""


REFUSALS = (ForwardRefused, CaptureFailed, CaptureOutOfMemory, CaptureBlockedError, VerificationError,
            FullGraphRefused, FakeMismatch)
"""piecewise refusing a model, with the reason and the fix in the message (the CLI prints it in one line)."""
