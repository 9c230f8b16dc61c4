"""The runtime: ``piecewise.compile`` and the ``PiecewiseModel`` it returns (the call path, the first call)."""

from __future__ import annotations

import contextlib
import contextvars
import warnings

import torch

from ..config import CaptureConfig
from ..diagnostics.blockers import Blocker, Frame
from ..diagnostics.classify import FIXES
from ..errors import CaptureFailed, ForwardRefused
from ..graph.stack import node_stack
from .arguments import call_tokens
from .model import PiecewiseModel, compile

__all__ = ["PiecewiseModel", "auto_trial", "breakable_trial", "compile", "trial_capture", "trial_splitting_ops"]


DOCTOR_MAX_TOKENS = 16
"""The top of the ladder the doctor's trial first calls use (1, 2, 4, 8 and 16 tokens), or the
inputs' token count where that is larger."""


_splitting_ops: contextvars.ContextVar = contextvars.ContextVar("piecewise_trial_splitting_ops", default=None)


@contextlib.contextmanager
def trial_splitting_ops(names):
    """The trials inside take ``CaptureConfig(splitting_ops=names)`` (None: every op made with ``split=True``)."""
    token = _splitting_ops.set(names)
    try:
        yield
    finally:
        _splitting_ops.reset(token)


def trial_capture(model: torch.nn.Module, args: tuple, kwargs: dict, frontend: str = "dynamo",
                  size_notes: list[str] | None = None, taken: list | None = None) -> list:
    """Run the runtime's first call on these inputs (the vLLM ladder up to ``DOCTOR_MAX_TOKENS``; CUDA graphs where
    the model is on CUDA) and return what it refuses as doctor blockers: ``capture_illegal`` (CUDA only),
    ``token_mixing``, ``token_branch``, ``state_update``, ``token_argument_write``, ``frozen_value``, ...
    ``frontend="dynamo"`` is strict (the whole forward or a blocker). ``size_notes``, when given, receives the
    runner's notes on sizes it cannot serve; ``taken`` (with ``frontend="auto"``) the front-end it took and why.

    Used by ``piecewise.doctor``. The model runs several times on the inputs, as on a first call.
    """
    tokens = call_tokens(model, args, kwargs)
    breaks = frontend == "dynamo-breaks"  # Dynamo with graph breaks: auto's last candidate
    config = CaptureConfig(max_tokens=max(DOCTOR_MAX_TOKENS, tokens), frontend="dynamo" if breaks else frontend,
                           strict=frontend == "dynamo", compiler="eager",  # what blocks capture, not what is fast
                           splitting_ops=_splitting_ops.get())
    runner = PiecewiseModel(model, config, None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # graph breaks: the doctor reports them from its own trace
            runner(*args, **kwargs)
    except CaptureFailed as exc:
        frames = node_stack(exc.node) if exc.node is not None else exc.chain
        return [Blocker(kind="capture_illegal", message=str(exc), chain=[Frame.from_summary(f) for f in frames],
                        fix=FIXES["capture_illegal"])]
    except ForwardRefused as exc:
        message = str(exc).removeprefix("piecewise: ")
        return [Blocker(kind=exc.kind.value, message=message, chain=[Frame.from_summary(f) for f in exc.chain],
                        fix=FIXES[exc.kind.value])]
    finally:
        runner.release_graphs()
        if size_notes is not None:
            size_notes.extend(runner.stats["size_notes"])
    if taken is not None:
        taken.extend([runner.stats["frontend"], runner.stats["frontend_reason"]])
    return []


def breakable_trial(model: torch.nn.Module, args: tuple, kwargs: dict) -> list:
    """``trial_capture`` with the breakable front-end: what stops it on these inputs (``capture_illegal`` on CUDA,
    ``token_mixing``, ``state_update``, ``token_argument_write``, ``token_branch``, ``frozen_value``)."""
    return trial_capture(model, args, kwargs, frontend="breakable")


def auto_trial(model: torch.nn.Module, args: tuple, kwargs: dict, dynamo_blocked: bool = False,
               breakable: list | None = None) -> tuple[str | None, str, list]:
    """What ``piecewise.compile(model)`` (``frontend="auto"``) does on these inputs: (the front-end it takes, why,
    []) or (None, "", what it refuses). ``dynamo_blocked``: Dynamo's strict trial already failed, so the search
    starts at breakable (the same order ``auto`` follows), whose blockers go to ``breakable`` when given."""
    if not dynamo_blocked:
        taken: list = []
        blockers = trial_capture(model, args, kwargs, frontend="auto", taken=taken)
        return (taken[0], taken[1], []) if taken else (None, "", blockers)
    refused = trial_capture(model, args, kwargs, frontend="breakable")
    if breakable is not None:
        breakable.extend(refused)
    if not refused:
        return "breakable", "Dynamo blocked", []
    if refused[0].kind in ("token_mixing", "state_update", "token_argument_write", "token_layout", "token_branch"):
        return None, "", refused  # what auto does not move on from
    broken = trial_capture(model, args, kwargs, frontend="dynamo-breaks")
    return ("dynamo", "Dynamo blocked; breakable failed; Dynamo with graph breaks", []) if not broken \
        else (None, "", refused)
