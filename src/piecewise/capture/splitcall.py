"""One call site of a splitting op, or of an in-place write cut out of the graphs: runs its body on the call's real
rows between two graph segments, and stages its outputs into static buffers whose rows past the real ones are
zero (so padding cannot spread NaN). In a full graph it runs inline, on the padded rows.

What carries the tokens (``Roles``) is fixed once per call site by the front-end that knows it: Dynamo from the
trace's symbolic token dimension, breakable from its survey of the forward at two token counts. Never from a shape
that happens to equal the padded size.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ForwardRefused, FullGraphRefused
from ..opaque import captured_whole
from .buffers import RowBuffer
from .state import Call, CaptureState, probe_call


@dataclass(frozen=True)
class Roles:
    """Which inputs and outputs of one call site carry the call's tokens."""

    inputs: tuple[tuple[int, int], ...] = ()
    """(input, token dimension) of each input tensor that has one row per token: cut to the real rows."""
    counts: tuple[tuple[int, Callable[[int], int] | None], ...] = ()
    """(input, function of the token count or None for the count itself) of each Python int that is the token count
    (``x.shape[0]``) or computed from it: given the real count."""
    outputs: tuple[bool, ...] | None = None
    """Per output (a single output is output 0): whether dimension 0 is the token dimension. None: decided by the
    output's shape at the first call (no better knowledge: Dynamo's trace after a graph break)."""
    written: tuple[int, ...] = ()
    """Inputs the body writes in place: the pad rows of those that carry tokens are zeroed after it (not in static
    tensors: rows there past the call's are the model's state)."""
    fixed: tuple[tuple[int, int], ...] = ()
    """(input, value) of each Python int seen to be the same at two token counts (breakable's survey): checked at
    every padded size, since a graph would give the op the value of its capture's size."""


@dataclass
class SplitCall:
    """One call site: ``run(args, call)`` runs ``body`` for ``call`` and returns what the graphs after it read."""

    name: str
    """The op (``ns::name``) or the cut write's label, for messages."""
    body: Callable[[Sequence[Any]], Any]
    """Runs the op on the inputs, in order."""
    roles: Roles
    state: CaptureState
    probed: bool = True
    """A splitting op of the model (not a cut write): ``verify`` records its real-row inputs."""
    cut: bool = False
    """An in-place write cut out of the graphs: inside a full graph only where the call has no pad row
    (``CaptureState.full_exact``)."""
    host: bool = False
    """A branch the host takes on a device value (``torch.cond``): once it ran, no full graph is made
    (``CaptureState.host_branch``, ``FullGraphs.settle``)."""
    by_shape: bool = False
    """No roles known (Dynamo after a graph break, where sizes are symbolic or not; a breakable call site its survey
    did not see): each size's token inputs are the non-static tensors as long as its padded size in dimension 0
    (in any dimension with ``any_dim``), its token outputs those as long as the real rows."""
    any_dim: bool = False
    buffers: list[Any] = field(default_factory=list)
    _sliced: dict[tuple[int, int], tuple[Sequence[Any], list[Any]]] = field(default_factory=dict)
    _by_size: dict[int, Roles] = field(default_factory=dict)
    _counted: dict[tuple[int, int], int] = field(default_factory=dict)

    def run(self, args: Sequence[Any], call: Call, keep_views: bool = False) -> Any:
        """The op for ``call``: inline on the padded rows in a full graph; else on the real rows, its outputs
        staged. ``keep_views``: ``args`` are the same tensors on every call of this size (replay), so the
        real-row views are made once."""
        state = self.state
        if call.full:
            if self.cut and call.num_tokens == call.size:  # no pad row: the write is exact inside the graph
                state.full_exact = True
                return self.body(args)
            if self.cut or not captured_whole(self.name):
                raise FullGraphRefused(
                    f"{'an in-place write into a static tensor' if self.cut else self.name} is cut out of the "
                    f"pieces and cannot run inside a padded full graph")
            return self.body(args)
        rows, size = call.num_tokens, call.size
        state.cut_runs += self.cut
        if self.host:
            state.host_branch = self.name
        roles = self._roles(args, size) if self.by_shape else self.roles
        if (roles.counts or roles.fixed) and not keep_views:
            self._check_counts(args, size, roles)
        real = args if rows == size else self._real_rows(args, rows, size, roles, keep_views)
        if state.probe is not None and self.probed:
            probe_call(state, list(real))
        result = self.body(real)
        if rows != size:  # a staged input's pad rows back to zero; a static tensor's rows past the call are the
            # model's state, which eager leaves as they are (``buf[:T] = x`` writes T rows)
            static = state.static_storages
            for index, dim in roles.inputs:
                if index in roles.written and args[index].untyped_storage().data_ptr() not in static:
                    args[index].narrow(dim, rows, size - rows).zero_()
        return self._stage(result, rows, size, args, roles)

    def takes_tokens(self, args: Sequence[Any], size: int) -> bool:
        """Whether any input carries the call's token rows (a write that takes none stays inside the graphs)."""
        return bool((self._roles(args, size) if self.by_shape else self.roles).inputs)

    def _roles(self, args: Sequence[Any], size: int) -> Roles:
        roles = self._by_size.get(size)
        if roles is None:
            static = self.state.static_storages
            inputs = []
            for index, value in enumerate(args):
                if isinstance(value, torch.Tensor) and value.dim() > 0 \
                        and value.untyped_storage().data_ptr() not in static:
                    dims = [d for d in range(value.dim() if self.any_dim else 1) if value.shape[d] == size]
                    inputs.extend((index, d) for d in dims[:1])
            roles = self._by_size[size] = Roles(tuple(inputs), (), None, self.roles.written)
        return roles

    def _real_rows(self, args: Sequence[Any], rows: int, size: int, roles: Roles, keep: bool) -> list[Any]:
        cached = self._sliced.get((size, rows))
        if cached is not None and all(map(operator.is_, cached[0], args)):
            return cached[1]
        real = list(args)
        for index, dim in roles.inputs:
            value = real[index]
            real[index] = value[:rows] if dim == 0 else value.narrow(dim, 0, rows)
        for index, function in roles.counts:
            real[index] = rows if function is None else self._count(index, function, rows)
        if keep:
            self._sliced[(size, rows)] = (args, real)
        return real

    def _check_counts(self, args: Sequence[Any], size: int, roles: Roles) -> None:
        """At each size a call runs padded (before any replay): each int taken for the count, or a function of it,
        must be that at the padded size; another number would be given to the op as if it were."""
        for index, function in (*roles.counts, *((index, _Fixed(value)) for index, value in roles.fixed)):
            expected = size if function is None else self._count(index, function, size)
            if args[index] != expected:
                raise ForwardRefused(
                    f"piecewise: `{self.name}` is given {args[index]} at {size} tokens where its calls at two other "
                    f"token counts made it {_what(function)} ({expected} here): it changes with the padded token "
                    f"count in a way the real count cannot stand in for, so a call padded to this size would give "
                    f"the op a number of the padding. Pass the count (x.shape[0]) itself, or compute the number "
                    f"inside the op.",
                    "token_layout")

    def _count(self, index: int, function: Callable[[int], int], rows: int) -> int:
        value = self._counted.get((index, rows))
        if value is None:
            value = self._counted[(index, rows)] = int(function(rows))
        return value

    # --- outputs --------------------------------------------------------------------------------------------

    def _stage(self, result: Any, rows: int, size: int, args: Sequence[Any], roles: Roles) -> Any:
        if result is None:
            return None
        single = isinstance(result, torch.Tensor)
        values = [result] if single else list(result)
        if len(self.buffers) != len(values):
            self.buffers = [None] * len(values)
        staged = [self._stage_one(i, value, rows, size, args, roles) for i, value in enumerate(values)]
        return staged[0] if single else type(result)(staged)

    def _stage_one(self, index: int, value: Any, rows: int, size: int, args: Sequence[Any], roles: Roles) -> Any:
        if not isinstance(value, torch.Tensor) or any(value is arg for arg in args):
            return value  # a number, or an argument returned as it is (an in-place op's result)
        token = roles.outputs[index] if roles.outputs is not None else value.dim() > 0 and value.shape[0] == rows
        buffer = self.buffers[index]
        if token:
            if not isinstance(buffer, RowBuffer) or buffer.buffer.dtype != value.dtype \
                    or buffer.buffer.shape[1:] != value.shape[1:]:
                shape = (self.state.max_tokens, *value.shape[1:])
                buffer = self.buffers[index] = RowBuffer(torch.zeros(shape, dtype=value.dtype, device=value.device))
                self._stable(buffer.buffer)
            buffer.write(value, rows)
            return buffer.rows(size)
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != value.dtype or buffer.shape != value.shape:
            buffer = self.buffers[index] = torch.empty_like(value, memory_format=torch.contiguous_format)
            self._stable(buffer)
        buffer.copy_(value)
        return buffer

    def _stable(self, buffer: torch.Tensor) -> None:
        self.state.stable_ptrs.add(buffer.data_ptr())
        self.state.buffer_storages.add(buffer.untyped_storage().data_ptr())

    def release_views(self) -> None:
        """Forget the real-row views made for replay (their arguments may become non-owning aliases)."""
        self._sliced.clear()


class _Fixed:
    """The function of the count that is one value."""

    __slots__ = ("value",)

    def __init__(self, value: int):
        self.value = value

    def __call__(self, count: int) -> int:
        return self.value


def _what(function: Callable[[int], int] | None) -> str:
    return "the count" if function is None else "a constant" if isinstance(function, _Fixed) else \
        "a function of the count"
