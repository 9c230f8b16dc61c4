"""An opaque op's fake against the op itself: Dynamo traces the rest of the forward with the fake's outputs, so a fake
of another shape than the op's makes every later line traced for the wrong one (a Dynamo error about some later op,
or wrong numbers). The op's first eager call runs its fake once on meta copies of the same inputs and compares."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")  # no device work
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _tensors(v)] if isinstance(value, (list, tuple)) else []


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def fake_mismatch(name: str, op: Callable, args: tuple, kwargs: dict, result: Any) -> str | None:
    """What the fake of op ``name`` gets wrong about ``result`` (the op's outputs for ``args``/``kwargs``), or None.
    A fake that cannot run on meta tensors (a data-dependent size) goes unchecked, and so does a call inside a CUDA
    graph capture."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    try:
        fake = op(*_meta(args), **{key: _meta(value) for key, value in kwargs.items()})
    except Exception:  # noqa: BLE001 - the fake needs fake tensors or fails: Dynamo's trace says so
        logger.debug("the fake of %s did not run on meta tensors", name, exc_info=True)
        return None
    real, faked = _tensors(result), _tensors(fake)
    inputs = ", ".join(_describe(t) for t in _tensors([*args, *kwargs.values()])) or "none"
    fix = ("Dynamo traces the forward with the fake's outputs, so the code after the op would be traced for the "
           "wrong shape: make the fake return the real output's shape and dtype (e.g. x.new_empty(...) from its "
           "inputs)")
    if len(real) != len(faked):
        return (f"piecewise: the fake of opaque op `{name}` returns {len(faked)} tensor(s), the op {len(real)} "
                f"(tensor inputs: {inputs}). {fix}.")
    for index, (output, fake_output) in enumerate(zip(real, faked)):
        if output.shape != fake_output.shape or output.dtype != fake_output.dtype:
            which = f"output {index} " if len(real) > 1 else ""
            return (f"piecewise: the fake of opaque op `{name}` returns {which}{_describe(fake_output)}, but the op "
                    f"returned {_describe(output)} on the same inputs (tensor inputs: {inputs}). {fix}.")
    return None
