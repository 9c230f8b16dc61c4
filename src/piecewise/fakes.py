"""An opaque op's fake against the op itself: Dynamo traces the rest of the forward with the fake's outputs, so a fake
of another shape than the op's makes every later line traced for the wrong one (a Dynamo error about some later op,
or wrong numbers). The op's first eager call runs its fake once on meta copies of the same inputs and compares.

Strides are part of the fake's promise too: compiled pieces (Inductor) assert the strides they were traced with. An
op whose fake returns contiguous tensors gets its outputs made contiguous on every call (a transposed result is
the common slip, and a copy is its fix); a fake of other strides must match the op's."""

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


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(size < 2 or x == y for size, x, y in zip(a.shape, a.stride(), b.stride()))


def contiguous_outputs(result: Any) -> Any:
    """``result`` (a tensor, or a list / tuple of them) with each tensor contiguous."""
    if isinstance(result, torch.Tensor):
        return result if result.is_contiguous() else result.contiguous()
    if isinstance(result, (list, tuple)):
        return type(result)(contiguous_outputs(value) for value in result)
    return result


def fake_mismatch(name: str, op: Callable, args: tuple, kwargs: dict, result: Any) -> tuple[str | None, bool]:
    """What the fake of op ``name`` gets wrong about ``result`` (the op's outputs for ``args``/``kwargs``), or None;
    and whether the fake's outputs are all contiguous (the op's are then made so: ``contiguous_outputs``). A fake
    that cannot run on meta tensors (a data-dependent size) goes unchecked, and so does a call inside a CUDA graph
    capture."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None, False
    try:
        fake = op(*_meta(args), **{key: _meta(value) for key, value in kwargs.items()})
    except Exception:  # noqa: BLE001 - the fake needs fake tensors or fails: Dynamo's trace says so
        logger.debug("the fake of %s did not run on meta tensors", name, exc_info=True)
        return None, False
    real, faked = _tensors(result), _tensors(fake)
    inputs = ", ".join(_describe(t) for t in _tensors([*args, *kwargs.values()])) or "none"
    fix = ("Dynamo traces the forward with the fake's outputs, so the code after the op would be traced for the "
           "wrong shape: make the fake return the real output's shape and dtype (e.g. x.new_empty(...) from its "
           "inputs)")
    if len(real) != len(faked):
        return (f"piecewise: the fake of opaque op `{name}` returns {len(faked)} tensor(s), the op {len(real)} "
                f"(tensor inputs: {inputs}). {fix}."), False
    contiguous = bool(faked) and all(t.is_contiguous() for t in faked)
    for index, (output, fake_output) in enumerate(zip(real, faked)):
        which = f"output {index} " if len(real) > 1 else ""
        if output.shape != fake_output.shape or output.dtype != fake_output.dtype:
            return (f"piecewise: the fake of opaque op `{name}` returns {which}{_describe(fake_output)}, but the op "
                    f"returned {_describe(output)} on the same inputs (tensor inputs: {inputs}). {fix}."), False
        if not contiguous and not _same_strides(output, fake_output):
            return (f"piecewise: the fake of opaque op `{name}` returns {which}{_describe(fake_output)} with strides "
                    f"{fake_output.stride()}, but the op returned strides {output.stride()} on the same inputs "
                    f"(tensor inputs: {inputs}). Compiled pieces assume the fake's strides: return contiguous "
                    f"tensors from both (x.new_empty(shape) in the fake), or make the fake's strides the op's "
                    f"(torch.empty_strided)."), False
    return None, contiguous
