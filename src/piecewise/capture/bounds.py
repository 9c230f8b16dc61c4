"""Index bounds of padded runs. A padded call indexes with what its padding rows hold and with its padded size (a
position table read at ``arange(padded size)``): a model that serves every real call may index past a table of
fewer rows than the top capture size. On CUDA that is a device-side assert, which ends the CUDA context. So the
first call runs the largest size once with ``BoundsCheck`` (``CaptureState.bounds``), which checks the indices of
the ops that take some before launching them (``runtime.bounds`` leaves out the sizes that fail)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx.interpreter import Interpreter
from torch.utils._python_dispatch import TorchDispatchMode

from ..graph.tokens import node_place


INDEX_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
"""Tensor dtypes that index (the checks read their largest value on the host)."""


class IndexOutOfRange(Exception):
    """An op of a padded run would index past its tensor."""

    def __init__(self, op: str, where: str, value: int, extent: int):
        super().__init__(f"`{op}` at {where} would index {value} in a dimension of {extent}")
        self.op, self.where, self.value, self.extent = op, where, value, extent


def _one(func, args: tuple, kwargs: dict, tensor: int, dim: int | None, index: int) -> list[tuple[Any, int]]:
    """(index tensor, extent) for ops taking one index tensor along ``dim`` (None: the tensor's elements)."""
    source = args[tensor]
    where = args[index] if index < len(args) else None
    if dim is None:
        return [(where, source.numel())]
    axis = args[dim] if dim < len(args) else kwargs.get("dim", 0)
    return [(where, source.shape[axis])] if source.dim() else []


def _indices(func, args: tuple, kwargs: dict) -> list[tuple[Any, int]]:
    """(index tensor, extent) for advanced indexing: ``x[i, j]`` reads dimension k with the k-th index tensor."""
    source, indices = args[0], args[1]
    return [(index, source.shape[k]) for k, index in enumerate(indices) if index is not None and k < source.dim()]


_CHECKS = {
    "aten::embedding": lambda f, a, k: [(a[1], a[0].shape[0])],
    "aten::index_select": lambda f, a, k: _one(f, a, k, 0, 1, 2),
    "aten::gather": lambda f, a, k: _one(f, a, k, 0, 1, 2),
    "aten::take": lambda f, a, k: _one(f, a, k, 0, None, 1),
    "aten::index": _indices,
    "aten::index_put": _indices,
    "aten::index_put_": _indices,
    "aten::_index_put_impl_": _indices,
    **{name: (lambda f, a, k: _one(f, a, k, 0, 1, 2)) for name in (
        "aten::index_copy", "aten::index_copy_", "aten::index_add", "aten::index_add_", "aten::index_fill",
        "aten::index_fill_", "aten::scatter", "aten::scatter_", "aten::scatter_add", "aten::scatter_add_",
        "aten::scatter_reduce", "aten::scatter_reduce_")},
}


class BoundsCheck(TorchDispatchMode):
    """Raise ``IndexOutOfRange`` before an op would index past its tensor (one wait for the device per such op: for
    a rehearsal run only). ``where()`` names the model line running now; ``node``, while an FX graph runs node by
    node (``run_checked``), the node whose line it is."""

    def __init__(self, where: Callable[[], str]):
        super().__init__()
        self.where = where
        self.node: Any = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = _CHECKS.get(func._schema.name)
        if check is not None:
            for index, extent in check(func, args, kwargs):
                if isinstance(index, torch.Tensor) and index.numel() and not index.is_floating_point() \
                        and index.dtype != torch.bool:
                    low, high = (int(v) for v in torch.aminmax(index))
                    if high >= extent or low < -extent:
                        where = node_place(self.node) if self.node is not None else self.where()
                        raise IndexOutOfRange(func.overloadpacket.__name__, where, high if high >= extent else low,
                                              extent)
        return func(*args, **kwargs)




class _NodeByNode(Interpreter):
    def __init__(self, graph: torch.fx.GraphModule, check: BoundsCheck):
        super().__init__(graph)
        self.check = check

    def run_node(self, node: torch.fx.Node) -> Any:
        self.check.node = node
        return super().run_node(node)


def run_checked(graph: torch.fx.GraphModule, args: tuple, check: BoundsCheck) -> Any:
    """Run a traced piece op by op under ``check`` (its compiled form would run kernels the check cannot see)."""
    try:
        with check:
            return _NodeByNode(graph, check).run(*args)
    finally:
        check.node = None
