"""An opaque op's fake against the op itself: Dynamo traces the rest of the forward with the fake's outputs, so a fake
of another shape than the op's makes every later line traced for the wrong one (a Dynamo error about some later op,
or wrong numbers). The op's first eager call runs its fake once on meta copies of the same inputs and compares.

Strides are part of the fake's promise too: compiled pieces (Inductor) assert the strides they were traced with. An
op whose fake returns contiguous tensors while the op returned another layout gets its outputs made contiguous at
every call (a transposed result is the common slip, and a copy is its fix); a fake of other strides must match the
op's where Inductor compiles."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .capture.segment import stream_capturing

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
    """``result`` (a tensor, or a list / tuple of them) with each tensor contiguous (itself where it is)."""
    if isinstance(result, torch.Tensor):
        return result if result.is_contiguous() else result.contiguous()
    if isinstance(result, (list, tuple)) and not all(not isinstance(v, torch.Tensor) or v.is_contiguous()
                                                     for v in result):
        return type(result)(contiguous_outputs(value) for value in result)
    return result


@dataclass
class FakeCheck:
    """What an op's first checked call found about its fake."""

    mismatch: str | None = None
    """A shape, dtype or count the fake gets wrong: ``compile`` refuses the op."""
    strides: str | None = None
    """Strides the fake gets wrong (a fake of other strides than contiguous): refused where Inductor compiles."""
    contiguous: bool = False
    """The fake's outputs are contiguous and the op returned another layout: its outputs are made contiguous at
    every call (``contiguous_outputs``)."""


def fake_mismatch(name: str, op: Callable, args: tuple, kwargs: dict, result: Any) -> FakeCheck | None:
    """The fake of op ``name`` against ``result`` (the op's outputs for ``args``/``kwargs``); None inside a CUDA
    graph capture (checked at a later call). A fake that cannot run on meta tensors (a data-dependent size) goes
    unchecked."""
    if stream_capturing():
        return None
    try:
        fake = op(*_meta(args), **{key: _meta(value) for key, value in kwargs.items()})
    except Exception:  # noqa: BLE001 - the fake needs fake tensors or fails: Dynamo's trace says so
        logger.debug("the fake of %s did not run on meta tensors", name, exc_info=True)
        return FakeCheck()
    real, faked = _tensors(result), _tensors(fake)
    inputs = ", ".join(_describe(t) for t in _tensors([*args, *kwargs.values()])) or "none"
    fix = ("Dynamo traces the forward with the fake's outputs, so the code after the op would be traced for the "
           "wrong shape: make the fake return the real output's shape and dtype (e.g. x.new_empty(...) from its "
           "inputs)")
    if len(real) != len(faked):
        return FakeCheck(f"piecewise: the fake of opaque op `{name}` returns {len(faked)} tensor(s), the op "
                         f"{len(real)} (tensor inputs: {inputs}). {fix}.")
    contiguous = bool(faked) and all(t.is_contiguous() for t in faked)
    for index, (output, fake_output) in enumerate(zip(real, faked)):
        which = f"output {index} " if len(real) > 1 else ""
        if output.shape != fake_output.shape or output.dtype != fake_output.dtype:
            return FakeCheck(f"piecewise: the fake of opaque op `{name}` returns {which}{_describe(fake_output)}, "
                             f"but the op returned {_describe(output)} on the same inputs (tensor inputs: {inputs}). "
                             f"{fix}.")
        if not contiguous and not _same_strides(output, fake_output):
            return FakeCheck(strides=(
                f"piecewise: the fake of opaque op `{name}` returns {which}{_describe(fake_output)} with strides "
                f"{fake_output.stride()}, but the op returned strides {output.stride()} on the same inputs (tensor "
                f"inputs: {inputs}). Compiled pieces assume the fake's strides: return contiguous tensors from "
                f"both (x.new_empty(shape) in the fake), or make the fake's strides the op's (torch.empty_strided)."))
    return FakeCheck(contiguous=contiguous and not all(t.is_contiguous() for t in real))


def resolved_signature(impl: Callable) -> tuple[inspect.Signature, dict[str, Any]]:
    """``impl``'s signature and annotations for an op's wrapper, string annotations (``from __future__ import
    annotations``) evaluated in ``impl``'s module: torch would evaluate them in the wrapper's, where ``Tensor`` or
    ``Optional`` may not be defined."""
    try:
        signature = inspect.signature(impl, eval_str=True)
    except Exception:  # noqa: BLE001 - a name its module lacks too: torch's own error says which
        signature = inspect.signature(impl)
    annotations = {name: p.annotation for name, p in signature.parameters.items() if p.annotation is not p.empty}
    if signature.return_annotation is not signature.empty:
        annotations["return"] = signature.return_annotation
    return signature, annotations
