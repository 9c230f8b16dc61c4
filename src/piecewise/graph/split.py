"""Cut a Dynamo graph at splitting ops: pieces to capture, and the ops that run eagerly between them.

A pure function: graph in, pieces out, no side effects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx.passes.split_module import split_module

from ..opaque import op_name


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
    graph: torch.fx.GraphModule, splitting_ops: frozenset[str], eager_nodes: dict[torch.fx.Node, str] | None = None
) -> tuple[torch.fx.GraphModule, list[Partition]]:
    """Split ``graph`` so every splitting-op call, and every node of ``eager_nodes`` (node → label), sits alone
    in its own partition.

    Partitions keep the original order; the returned list follows the execution order of the split graph.
    """
    eager_nodes = eager_nodes or {}
    partition_of: dict[torch.fx.Node, int] = {}
    split_names: dict[int, str] = {}
    current = 0
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        op = eager_nodes.get(node) or _is_split_node(node, splitting_ops)
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
