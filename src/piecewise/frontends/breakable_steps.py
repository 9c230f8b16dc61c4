"""What the breakable front-end records per size: graph segments and the splitting calls between them, replayed in
order, and the forward's output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from ..capture.buffers import map_tensors
from ..capture.outputs import output_tensors
from ..capture.segment import Segment
from ..capture.splitcall import SplitCall
from ..capture.state import CaptureState


def storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class Step:
    """One splitting call (or cut-out write) between two segments: its call site and its inputs at this size."""

    __slots__ = ("split", "leaves")

    def __init__(self, split: SplitCall, leaves: list):
        self.split, self.leaves = split, leaves

    def release(self, keep: Callable[[torch.Tensor], bool]) -> None:
        """Hold pool tensors as non-owning aliases, so that the pool can serve other sizes."""
        self.leaves = [leaf if not isinstance(leaf, torch.Tensor) or keep(leaf) else _compat.non_owning_alias(leaf)
                       for leaf in self.leaves]
        self.split.release_views()


class Recording:
    """One size's segments and splitting calls, in order, and the forward's output with its token dimensions."""

    def __init__(self, size: int):
        self.size = size
        self.steps: list[Segment | Step] = []
        self.output: Any = None
        self.output_dims: list[int | None] | None = None
        """Per leaf of the output: its token dimension (None: it has none); None: not known."""
        self.keep: Callable[[torch.Tensor], bool] = lambda tensor: True

    @property
    def graphs(self) -> int:
        return sum(1 for step in self.steps if isinstance(step, Segment))

    def replay(self, state: CaptureState) -> Any:
        call = state.call
        for step in self.steps:
            if type(step) is Step:
                step.split.run(step.leaves, call, keep_views=True)
            else:
                step.replay()
        note_output_dims(state, self.output, self.output_dims)
        return self.output

    def release_outputs(self, size: int) -> None:
        for step in self.steps:
            if type(step) is Step:
                step.release(self.keep)
        self.output = map_tensors(self.output, lambda t: t if self.keep(t) else _compat.non_owning_alias(t))


def note_output_dims(state: CaptureState, output: Any, dims: list[int | None] | None) -> None:
    """Tell ``PiecewiseModel.finish`` the token dimension of each tensor of the forward's output."""
    if dims is None:
        return
    if isinstance(output, torch.Tensor):
        state.token_outputs[id(output)] = dims[0]
        return
    for leaf, dim in zip(output_tensors(output), dims):
        state.token_outputs[id(leaf)] = dim


def written_indices(func: Any, leaves: list, spec: Any) -> tuple[int, ...]:
    """Positions among an op call's flattened inputs of the tensors it writes in place (its schema's mutable
    arguments)."""
    if not _written_positions(func):
        return ()
    args, kwargs = torch.utils._pytree.tree_unflatten(list(leaves), spec)
    targets = written_tensors(func, args, kwargs)
    return tuple(i for i, leaf in enumerate(leaves) if any(leaf is t for t in targets))


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op call writes in place (its schema's mutable arguments), read from its arguments."""
    targets = []
    for index, name in _written_positions(func):
        value = args[index] if index < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            targets.append(value)
        elif isinstance(value, (list, tuple)):
            targets.extend(v for v in value if isinstance(v, torch.Tensor))
    return targets


def _written_positions(func: Any) -> list[tuple[int, str]]:
    positions = _WRITTEN.get(func)
    if positions is None:
        positions = _WRITTEN[func] = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                                      if a.alias_info is not None and a.alias_info.is_write]
    return positions


_WRITTEN: dict[Any, list[tuple[int, str]]] = {}
