"""What the breakable front-end records per size: graphs and the splitting-op calls between them, replayed in
order; and how a call's token tensors and outputs are told apart."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import _compat
from ..capture.buffers import RowBuffer, map_tensors
from ..capture.state import CaptureState, probe_call


def storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def narrow(tensor: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    return tensor[:rows] if dim == 0 else tensor.narrow(dim, 0, rows)


class Step:
    """One splitting-op call (or cut-out write) recorded at capture, replayed between two graphs.

    ``tokens``: (leaf, token dimension) of its token arguments; ``buffers``: per output, the ``RowBuffer`` of a
    token output, the fixed buffer of any other tensor output, or None (an argument returned, a non-tensor)."""

    __slots__ = ("call", "leaves", "spec", "tokens", "zero_after", "buffers", "single", "sliced", "probed")

    def __init__(self, call: Callable, leaves: list, spec: Any, tokens: list[tuple[int, int]],
                 zero_after: list[tuple[int, int]], buffers: list, single: bool, probed: bool):
        self.call, self.leaves, self.spec = call, leaves, spec
        self.tokens, self.zero_after = tokens, zero_after
        self.buffers, self.single = buffers, single
        self.probed = probed
        """A splitting op of the model (not a cut-out write): ``verify`` records its inputs."""
        self.sliced: dict[int, tuple[tuple, dict]] = {}

    def arguments(self, rows: int, size: int) -> tuple[tuple, dict]:
        cached = self.sliced.get(rows)
        if cached is None:
            leaves = list(self.leaves)
            if rows != size:
                for index, dim in self.tokens:
                    leaves[index] = narrow(leaves[index], dim, rows)
            cached = self.sliced[rows] = tree_unflatten(leaves, self.spec)
        return cached

    def run(self, rows: int, size: int, state: CaptureState) -> None:
        args, kwargs = self.arguments(rows, size)
        if state.probe is not None and self.probed:
            probe_call(state, args, kwargs)
        result = self.call(*args, **kwargs)
        if rows != size:
            for index, dim in self.zero_after:
                self.leaves[index].narrow(dim, rows, size - rows).zero_()
        if result is None:
            return
        for buffer, value in zip(self.buffers, [result] if self.single else result):
            if isinstance(buffer, RowBuffer):
                buffer.write(value, rows)
            elif buffer is not None:
                buffer.copy_(value)

    def release(self, keep: Callable[[torch.Tensor], bool]) -> None:
        """Hold pool tensors as non-owning aliases, so that the pool can serve other sizes."""
        self.leaves = [leaf if not isinstance(leaf, torch.Tensor) or keep(leaf) else _compat.non_owning_alias(leaf)
                       for leaf in self.leaves]
        self.sliced.clear()


class Recording:
    """One size's graphs and recorded calls, in order, the forward's output, and the arguments' signature."""

    def __init__(self, size: int, signature: tuple):
        self.size = size
        self.signature = signature
        self.steps: list[Any] = []  # torch.cuda.CUDAGraph or Step
        self.output: Any = None
        self.keep: Callable[[torch.Tensor], bool] = lambda tensor: True

    @property
    def graphs(self) -> int:
        return sum(1 for step in self.steps if isinstance(step, torch.cuda.CUDAGraph))

    def replay(self, rows: int, state: CaptureState) -> Any:
        size = self.size
        for step in self.steps:
            if isinstance(step, Step):
                step.run(rows, size, state)
            else:
                step.replay()
        return self.output

    def release_outputs(self, size: int) -> None:
        for step in self.steps:
            if isinstance(step, Step):
                step.release(self.keep)
        self.output = map_tensors(self.output, lambda t: t if self.keep(t) else _compat.non_owning_alias(t))


def signature(arguments: dict[str, Any]) -> tuple:
    """What the graphs of a size depend on besides the values of its tensors: which arguments are tensors, and
    their dtypes and shapes; the values of the others."""
    return tuple((name, (value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) else repr(value))
                 for name, value in arguments.items())


def token_outputs(func: Any, args: tuple, kwargs: dict, tokens: list[tuple[int, int]], rows: int,
                  result: list, cache: dict) -> list[bool] | None:
    """Which of a splitting op's outputs carry the token rows: its fake run with one row more tells (cached per
    op and input shapes with the token dimensions left out, so once for every size). None when the op has no fake
    to run."""
    leaves, spec = tree_flatten((args, kwargs))
    dims = dict(tokens)
    key = (func, tuple((_shape_but(leaf.shape, dims.get(index)), leaf.dtype) if isinstance(leaf, torch.Tensor)
                       else None for index, leaf in enumerate(leaves)))
    if key in cache:
        return cache[key]
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode() as mode:
            fakes = []
            for index, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor):
                    shape = list(leaf.shape)
                    if index in dims:
                        shape[dims[index]] = rows + 1
                    fakes.append(torch.empty(shape, dtype=leaf.dtype, device=leaf.device))
                else:
                    fakes.append(leaf)
            fake_args, fake_kwargs = tree_unflatten(fakes, spec)
            out = func(*fake_args, **fake_kwargs)
        del mode
    except Exception:  # noqa: BLE001 - no fake or meta kernel: the caller falls back to shapes
        cache[key] = None
        return None
    outs = [out] if isinstance(out, torch.Tensor) or out is None else list(out)
    found = []
    for real, fake in zip(result, outs):
        if not isinstance(real, torch.Tensor) or not isinstance(fake, torch.Tensor):
            found.append(False)
            continue
        moved = [d for d in range(real.dim()) if d < fake.dim() and fake.shape[d] != real.shape[d]]
        if moved and moved != [0]:
            raise RuntimeError(
                f"piecewise: splitting op {func._schema.name} returns an output of shape {tuple(real.shape)} whose "
                f"token dimension is {moved[0]}, not 0; piecewise pads and cuts dimension 0: return it tokens-first "
                f"(e.g. .transpose(0, {moved[0]}) inside the op, and back outside it)")
        if moved == [0] and real.shape[0] != rows:
            raise RuntimeError(
                f"piecewise: splitting op {func._schema.name} returns an output of shape {tuple(real.shape)} for "
                f"{rows} token(s): its dimension 0 grows with the tokens but is not the token count; return "
                f"[tokens, ...] outputs (reshape inside the op)")
        found.append(moved == [0])
    cache[key] = found
    return found


def _shape_but(shape: torch.Size, dim: int | None) -> tuple:
    """``shape`` with dimension ``dim`` (the token dimension; None: none) left out."""
    return tuple(None if d == dim else extent for d, extent in enumerate(shape))


_WRITTEN: dict[Any, list[tuple[int, str]]] = {}


def written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (its schema's mutable arguments)."""
    positions = _WRITTEN.get(func)
    if positions is None:
        positions = _WRITTEN[func] = [
            (i, a.name) for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        ]
    found = []
    for index, name in positions:
        value = args[index] if index < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found
