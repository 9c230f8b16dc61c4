"""One splitting op of a traced graph (or an in-place write cut out of the pieces): a ``SplitCall`` whose roles the
trace's symbolic token dimension gives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from ..errors import ForwardRefused
from ..graph.split import eager_higher_order
from ..graph.tokens import is_token_tensor, output_values, placeholder_values, token_dims
from ..opaque import op_name, opaque_op_info
from .splitcall import Roles, SplitCall
from .state import CaptureState, Phase


def traced_roles(module: torch.fx.GraphModule, cut: bool, sizes: list[int]) -> Roles:
    """What carries the tokens in a traced splitting op's partition: input tensors in every dimension that is the
    token count at every capture size (the symbol itself, or an expression such as ``Min(s0, 9)`` that equals it
    there), Python ints that are the count or computed from it (``x.shape[0]``, ``2 * x.shape[0]``), outputs whose
    dimension 0 is it. An input dimension computed from the count otherwise cannot be cut to the real rows:
    refused (``token_layout``)."""
    values = placeholder_values(module)
    inputs = []
    for index, value in enumerate(values):
        inputs.extend((index, dim) for dim in token_dims(value))
        for dim, extent in enumerate(getattr(value, "shape", ())):
            if _compat.symbolic(extent) and not _compat.is_plain_symbol(extent):
                if all(_value_at(extent, size) == size for size in sizes):
                    inputs.append((index, dim))
                else:
                    raise ForwardRefused(
                        f"piecewise: input {index} of `{op_name(_only_op(module)) or 'a splitting op'}` has dimension "
                        f"{dim} of `{extent}` tokens: it grows with the token count without being it, so piecewise "
                        f"cannot cut it to a call's real tokens. Keep one row per token in one dimension (reshape "
                        f"[tokens * n, ...] to [tokens, n, ...]).", "token_layout")
    counts = tuple((index, _count_function(value)) for index, value in enumerate(values)
                   if isinstance(value, torch.SymInt) and _compat.symbolic(value))
    outputs = output_values(module)
    flat = [outputs] if not isinstance(outputs, (tuple, list)) else list(outputs)
    return Roles(tuple(inputs), counts, tuple(is_token_tensor(v) for v in flat), _written_inputs(module))


def _value_at(extent: torch.SymInt, size: int) -> int:
    expr = extent.node.expr
    return int(expr.subs({symbol: size for symbol in expr.free_symbols}))


def _only_op(module: torch.fx.GraphModule):
    nodes = [n for n in module.graph.nodes if n.op == "call_function"]
    return nodes[0].target if len(nodes) == 1 else None


def _count_function(value: torch.SymInt) -> Callable[[int], int] | None:
    """None for the token count itself; else the function of the count the value is (``2 * s0``)."""
    if _compat.is_plain_symbol(value):
        return None
    expr = value.node.expr
    symbols = list(expr.free_symbols)
    return lambda rows: int(expr.subs({symbol: rows for symbol in symbols}))


def _written_inputs(module: torch.fx.GraphModule) -> tuple[int, ...]:
    """Placeholders the partition's one op writes in place (its schema's mutable arguments)."""
    nodes = [n for n in module.graph.nodes if n.op == "call_function"]
    schema = getattr(nodes[0].target, "_schema", None) if len(nodes) == 1 else None
    if schema is None:
        return ()
    placeholders = {n: i for i, n in enumerate(n for n in module.graph.nodes if n.op == "placeholder")}
    written = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            node = nodes[0].args[position] if position < len(nodes[0].args) else nodes[0].kwargs.get(argument.name)
            if node in placeholders:
                written.append(placeholders[node])
    return tuple(written)


class SplitOpRunner:
    """What the split graph calls in place of one splitting op's partition."""

    def __init__(self, name: str, module: torch.fx.GraphModule, op: str, state: CaptureState, sizes: list[int],
                 cut: bool = False, by_shape: bool = False):
        self.name = name
        self.module = module
        self.op_name = op
        self.state = state
        self.call = self._direct_call(module) or module.forward
        call = self.call
        roles = Roles() if by_shape else traced_roles(module, cut, sizes)
        host = bool(eager_higher_order(module))
        self.split = SplitCall(op, lambda args: call(*args), roles, state, probed=not cut, cut=cut, host=host,
                               by_shape=by_shape)

    @staticmethod
    def _direct_call(module: torch.fx.GraphModule) -> Callable | None:
        """For piecewise's own opaque ops: call the Python body directly (the partition is one op call),
        skipping the dispatcher, which costs more than a small op itself."""
        nodes = [n for n in module.graph.nodes if n.op not in ("placeholder", "output")]
        if len(nodes) != 1 or nodes[0].op != "call_function":
            return None
        info = opaque_op_info(op_name(nodes[0].target) or "")
        if info is None or info.impl is None:
            return None
        output = next(n for n in module.graph.nodes if n.op == "output")
        if output.args[0] is not nodes[0]:
            return None
        placeholders = {n: i for i, n in enumerate(n for n in module.graph.nodes if n.op == "placeholder")}
        node = nodes[0]
        schema_args = node.target._schema.arguments if hasattr(node.target, "_schema") else None
        positional = list(node.args)
        keyword = dict(node.kwargs)
        if schema_args is not None:  # pass everything positionally, in schema order, defaults filled
            values = positional + [keyword.pop(a.name, a.default_value) for a in schema_args[len(positional) :]]
            positional, keyword = values, {}
        getters = [(placeholders[a], None) if isinstance(a, torch.fx.Node) else (None, a) for a in positional]
        if keyword or any(isinstance(a, (list, tuple, dict)) for a in positional):
            return None
        impl = info.impl
        count = len(placeholders)
        if [i for i, _ in getters[:count]] == list(range(count)) and all(i is None for i, _ in getters[count:]):
            # placeholders in order, constants last (the usual shape): no per-call list
            trailing = tuple(const for _, const in getters[count:])

            def call(*args):
                return impl(*args, *trailing)

            return call

        def call(*args):
            return impl(*[args[i] if i is not None else const for i, const in getters])

        return call

    def __call__(self, *args: Any) -> Any:
        state = self.state
        state.splitting_op_calls += 1
        call = state.call
        if call.phase is Phase.DIRECT:
            return self.call(*args)
        return self.split.run(args, call, keep_views=call.phase is Phase.REPLAY)
