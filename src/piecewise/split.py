"""Cut a Dynamo graph at splitting ops: pieces to capture, and the ops that run eagerly between them."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx.passes.split_module import split_module

from .opaque import op_name


@dataclass
class Partition:
    """One submodule of the split graph."""

    name: str
    """Attribute name of the submodule in the split graph (``submod_N``)."""
    module: torch.fx.GraphModule
    splitting_op: str | None
    """Name of the splitting op this partition holds, or None for a piece to compile and capture."""


def _is_split_node(node: torch.fx.Node, splitting_ops: frozenset[str]) -> str | None:
    if node.op != "call_function":
        return None
    name = op_name(node.target)
    return name if name in splitting_ops else None


def split_graph(
    graph: torch.fx.GraphModule, splitting_ops: frozenset[str]
) -> tuple[torch.fx.GraphModule, list[Partition]]:
    """Split ``graph`` so every splitting-op call sits alone in its own partition.

    Partitions keep the original order; the returned list follows the execution order of the split graph.
    """
    partition_of: dict[torch.fx.Node, int] = {}
    split_names: dict[int, str] = {}
    current = 0
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        op = _is_split_node(node, splitting_ops)
        if op is not None:
            current += 1
            partition_of[node] = current
            split_names[current] = op
            current += 1
        else:
            partition_of[node] = current

    split = split_module(graph, None, lambda node: partition_of[node], keep_original_order=True)
    partitions = []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        index = int(node.target.rsplit("_", 1)[1])
        partitions.append(Partition(node.target, getattr(split, node.target), split_names.get(index)))
    return split, partitions


def _written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The arguments ``node`` writes in place: a schema's mutable arguments, or ``self`` of an in-place method."""
    if (node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__")) or (
            node.op == "call_function" and node.target is operator.setitem):
        return [node.args[0]] if node.args and isinstance(node.args[0], torch.fx.Node) else []
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    written = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
        if isinstance(value, torch.fx.Node):
            written.append(value)
    return written


def _storage(node: torch.fx.Node) -> int | None:
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - a tensor without storage (some subclasses)
        return None


def writes_to_inputs(graph: torch.fx.GraphModule, inputs: list[torch.fx.Node]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(writing node, input placeholder) for every in-place write into the memory of one of ``inputs``."""
    storages = {_storage(node): node for node in inputs}
    storages.pop(None, None)
    found = []
    for node in graph.graph.nodes:
        for written in _written_args(node):
            placeholder = storages.get(_storage(written))
            if placeholder is not None:
                found.append((node, placeholder))
    return found
