"""Cut a Dynamo graph at splitting ops: pieces to capture, and the ops that run eagerly between them.

A pure function: graph in, pieces out, no side effects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx.passes.split_module import split_module

from ..opaque import op_name
from .tokens import user_line
from .writes import node_schema

BUILTIN_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "_c10d_functional_autograd", "c10d",
                                "profiler", "_dtensor", "inductor", "higher_order", "debugprims", "rngprims",
                                "_quantized"})
"""torch's own op namespaces; an op of any other is a custom op (``torch.library``, a C++ extension)."""

EAGER_HIGHER_ORDER = frozenset({"cond", "while_loop", "map"})
"""Higher-order ops whose branch or trip count comes from device values: no CUDA graph can hold them."""


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
        if node.op == "get_attr" and node.users and all(user in eager_nodes for user in node.users):
            continue  # a higher-order op's branch: goes with the op
        op = eager_nodes.get(node) or _is_split_node(node, splitting_ops)
        if op is not None:
            current += 1
            partition_of[node] = current
            split_names[current] = op
            current += 1
        else:
            partition_of[node] = current

    for node in graph.graph.nodes:
        if node.op == "get_attr" and node not in partition_of:
            partition_of[node] = partition_of[next(iter(node.users))]
    split = split_module(graph, None, lambda node: partition_of[node], keep_original_order=True)
    partitions = []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        index = int(node.target.rsplit("_", 1)[1])
        partitions.append(Partition(node.target, getattr(split, node.target), split_names.get(index)))
    return split, partitions


def eager_higher_order(graph: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """``torch.cond``, ``while_loop``, ``map`` nodes → a label each: they run eagerly between the pieces, on the real
    rows (their predicate read on the host at every call), their branches' subgraphs with them."""
    found = {}
    for node in graph.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator) \
                and node.target.name() in EAGER_HIGHER_ORDER:
            where = user_line(node)
            found[node] = f"torch.{node.target.name()}" + (f" ({where})" if where else "")
    return found


def is_custom_op(name: str | None, splitting_ops: frozenset[str]) -> bool:
    """Whether the op ``"ns::name"`` is a custom op other than the splitting ops: one whose Python runs only at
    capture, inside a graph."""
    return name is not None and name not in splitting_ops and name.partition("::")[0] not in BUILTIN_NAMESPACES


def unused_custom_ops(graph: torch.fx.GraphModule, splitting_ops: frozenset[str]) -> dict[torch.fx.Node, str]:
    """Custom-op nodes whose results go unused and whose schema declares no write → a label each: they run eagerly
    between the pieces. Such an op is called for what it does, not what it returns (a KV-cache write that declares
    nothing, as a schema with ``mutates_args=()`` over a cache it looks up by name); a compiler would remove it from
    a piece as dead code, and the model's state would go unwritten."""
    found = {}
    for node in graph.graph.nodes:
        if node.op != "call_function" or node.users or not is_custom_op(op_name(node.target), splitting_ops):
            continue
        schema = node_schema(node)
        if schema is not None and schema.is_mutable:
            continue  # a declared write: the write checks decide where it runs
        where = user_line(node)
        found[node] = f"`{op_name(node.target)}`, whose result goes unused" + (f" ({where})" if where else "")
    return found


def has_custom_ops(graph: torch.fx.GraphModule, splitting_ops: frozenset[str]) -> bool:
    """Whether ``graph`` calls a custom op other than the splitting ops."""
    return any(node.op == "call_function" and is_custom_op(op_name(node.target), splitting_ops)
               for node in graph.graph.nodes)
