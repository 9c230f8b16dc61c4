"""In-place writes in an FX graph: which node writes which input, and whether it reads what it overwrites."""

from __future__ import annotations

import operator

import torch

from ..opaque import op_name


_IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
})
_AUGMENTED = {"iadd": "+=", "isub": "-=", "imul": "*=", "itruediv": "/=", "ifloordiv": "//=", "imod": "%=",
              "ipow": "**=", "iand": "&=", "ior": "|=", "ixor": "^=", "ilshift": "<<=", "irshift": ">>="}
# In-place methods whose result depends on the tensor's previous value (run twice, they give another result).
ACCUMULATING_METHODS = frozenset({
    "add_", "sub_", "mul_", "div_", "true_divide_", "floor_divide_", "remainder_", "fmod_", "pow_", "addcmul_",
    "addcdiv_", "addmm_", "addbmm_", "baddbmm_", "addmv_", "addr_", "index_add_", "scatter_add_",
    "scatter_reduce_", "index_reduce_", "lerp_", "exp_", "log_", "neg_", "reciprocal_", "sqrt_", "rsqrt_",
    "abs_", "sigmoid_", "tanh_", "bitwise_xor_", "logical_not_", "cumsum_", "cumprod_", "t_", "transpose_",
    "squeeze_", "unsqueeze_", "resize_", "bitwise_not_", "square_", "sign_", "sin_", "cos_", "exponential_",
    "normal_", "uniform_", "bernoulli_", "random_", "geometric_", "cauchy_", "log_normal_",
})


def method_name(node: torch.fx.Node) -> str | None:
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
    name = method_name(node)
    if name in ACCUMULATING_METHODS:
        return True
    if name in ("index_put_", "_index_put_impl_"):
        accumulate = node.kwargs.get("accumulate", node.args[3] if len(node.args) > 3 else False)
        return bool(accumulate)
    if name == "scatter_":
        return node.kwargs.get("reduce", node.args[4] if len(node.args) > 4 else None) is not None
    return False


def node_schema(node: torch.fx.Node):
    """The schema of an op node: its overload's, or for an overload packet (Dynamo records ``torch.ops.ns.op(...)``
    as one) that of its only or default overload; None for anything else."""
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = target.overloads()
        name = "default" if "default" in overloads else overloads[0] if len(overloads) == 1 else None
        target = getattr(target, name) if name is not None else None
    return target._schema if isinstance(target, torch._ops.OpOverload) else None


def _written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The arguments ``node`` writes in place: a schema's mutable arguments, ``self`` of an in-place method,
    or the target of ``x[i] = v`` / ``x += v``."""
    if (node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__")) or (
            node.op == "call_function" and node.target in _IN_PLACE_OPERATORS):
        return [node.args[0]] if node.args and isinstance(node.args[0], torch.fx.Node) else []
    schema = node_schema(node)
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


def inputs_sharing_memory(inputs: list[torch.fx.Node], written: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """The ``inputs`` whose memory one of ``written`` shares (views of one tensor): copying one of them apart
    would part it from the writes."""
    storages = {_storage(node) for node in written} - {None}
    return [node for node in inputs if node not in written and _storage(node) in storages]


def describe_write(node: torch.fx.Node) -> str:
    """How the user wrote an in-place ``node``: ``x[...] = v``, ``+=``, ``.index_copy_()``, ``mylib::op``."""
    if node.op == "call_function" and node.target is operator.setitem:
        return "`x[...] = value`"
    if node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:
        return f"`{_AUGMENTED.get(node.target.__name__, node.target.__name__)}`"
    name = op_name(node.target) if node.op == "call_function" else None
    return name or f"`.{method_name(node)}()`"
