"""Cut a Dynamo graph at splitting ops: pieces to capture, and the ops that run eagerly between them."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

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


_IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
})
_AUGMENTED = {"iadd": "+=", "isub": "-=", "imul": "*=", "itruediv": "/=", "ifloordiv": "//=", "imod": "%=",
              "ipow": "**=", "iand": "&=", "ior": "|=", "ixor": "^=", "ilshift": "<<=", "irshift": ">>="}
# In-place methods whose result depends on the tensor's previous value (run twice, they give another result).
_ACCUMULATING_METHODS = frozenset({
    "add_", "sub_", "mul_", "div_", "true_divide_", "floor_divide_", "remainder_", "fmod_", "pow_", "addcmul_",
    "addcdiv_", "addmm_", "addbmm_", "baddbmm_", "addmv_", "addr_", "index_add_", "scatter_add_",
    "scatter_reduce_", "index_reduce_", "lerp_", "exp_", "log_", "neg_", "reciprocal_", "sqrt_", "rsqrt_",
    "abs_", "sigmoid_", "tanh_", "bitwise_xor_", "logical_not_", "cumsum_", "cumprod_", "t_", "transpose_",
    "squeeze_", "unsqueeze_", "resize_", "bitwise_not_", "square_", "sign_", "sin_", "cos_", "exponential_",
    "normal_", "uniform_", "bernoulli_", "random_", "geometric_", "cauchy_", "log_normal_",
})


def _method_name(node: torch.fx.Node) -> str | None:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        packet = getattr(node.target, "overloadpacket", None)
        name = getattr(packet, "__name__", None) or getattr(node.target, "__name__", None)
        return name if isinstance(name, str) else None
    return None


def accumulates(node: torch.fx.Node) -> bool:
    """Whether an in-place ``node`` reads what it overwrites (``+=``, ``add_``, ``index_put_(accumulate=True)``,
    ``scatter_(reduce=...)``): run again on the same inputs, it gives another result."""
    if node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:
        return node.target is not operator.setitem
    name = _method_name(node)
    if name in _ACCUMULATING_METHODS:
        return True
    if name in ("index_put_", "_index_put_impl_"):
        accumulate = node.kwargs.get("accumulate", node.args[3] if len(node.args) > 3 else False)
        return bool(accumulate)
    if name == "scatter_":
        return node.kwargs.get("reduce", node.args[4] if len(node.args) > 4 else None) is not None
    return False


def _written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The arguments ``node`` writes in place: a schema's mutable arguments, ``self`` of an in-place method,
    or the target of ``x[i] = v`` / ``x += v``."""
    if (node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__")) or (
            node.op == "call_function" and node.target in _IN_PLACE_OPERATORS):
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


def describe_write(node: torch.fx.Node) -> str:
    """How the user wrote an in-place ``node``: ``x[...] = v``, ``+=``, ``.index_copy_()``, ``mylib::op``."""
    if node.op == "call_function" and node.target is operator.setitem:
        return "`x[...] = value`"
    if node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:
        return f"`{_AUGMENTED.get(node.target.__name__, node.target.__name__)}`"
    name = op_name(node.target) if node.op == "call_function" else None
    return name or f"`.{_method_name(node)}()`"


def user_line(node: torch.fx.Node) -> str:
    """``file:line`` of the model code that made ``node`` (its innermost frame), or "" when unknown."""
    from .diagnostics._dynamo import node_stack  # the diagnostics import this module

    frames = node_stack(node)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


_ALONG_DIM = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "softmax", "log_softmax", "_softmax", "_log_softmax", "cumsum",
    "cumprod", "cummax", "cummin", "logsumexp", "prod", "norm", "var", "std", "sort", "argsort", "topk", "argmax",
    "argmin", "flip", "roll", "any", "all", "nansum", "median", "mode", "kthvalue",
})


def _token_dims(value: Any) -> list[int]:
    """Dimensions of a (fake) tensor whose size involves a dynamic symbol (the token count)."""
    if not isinstance(value, torch.Tensor):
        return []
    return [i for i, d in enumerate(value.shape) if isinstance(d, torch.SymInt) and d.node.expr.free_symbols]


def token_mixing_nodes(graph: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes that may combine rows of the token dimension: their tensor inputs have it and their outputs do not
    (a reduction, a contraction, ``x[-1]``), or they reduce, scan or sort along it. A heuristic, for messages."""
    found = []
    for node in graph.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        inputs = [n for n in node.all_input_nodes if _token_dims(n.meta.get("example_value"))]
        if not inputs:
            continue
        outputs = [v for v in torch.utils._pytree.tree_leaves(node.meta.get("example_value"))
                   if isinstance(v, torch.Tensor)]
        if outputs and not any(_token_dims(v) for v in outputs):
            found.append(node)
            continue
        if _method_name(node) in _ALONG_DIM:
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
            source = node.args[0].meta.get("example_value") if isinstance(node.args[0], torch.fx.Node) else None
            if isinstance(dim, int) and isinstance(source, torch.Tensor) and source.dim() > 0:
                if dim % source.dim() in _token_dims(source):
                    found.append(node)
    return found
