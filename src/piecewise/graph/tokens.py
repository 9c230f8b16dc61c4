"""The token dimension in traced graphs: the one rule for "is this a token tensor", and where rows may mix."""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from .stack import node_stack
from .writes import method_name


def is_token_tensor(fake: Any) -> bool:
    """A (fake) tensor whose dimension 0 is the symbolic token count."""
    return isinstance(fake, torch.Tensor) and fake.dim() > 0 and _compat.is_plain_symbol(fake.shape[0])


def token_dims(fake: Any) -> list[int]:
    """The dimensions of ``fake`` that are the token count (none: not a token tensor)."""
    if not isinstance(fake, torch.Tensor):
        return []
    return [d for d, size in enumerate(fake.shape) if _compat.is_plain_symbol(size)]


def refuse_other_token_dims(graph: torch.fx.GraphModule, splitting_ops: frozenset[str]) -> None:
    """Refuse a splitting op that returns the tokens in another dimension than 0 only (gpt-fast's [B, H, S, D]
    attention): its output is padded and cut along dimension 0, which there is not the tokens."""
    from ..errors import ForwardRefused
    from ..opaque import op_name

    for node in graph.graph.nodes:
        if node.op != "call_function" or op_name(node.target) not in splitting_ops:
            continue
        value = node.meta.get("example_value")
        for index, fake in enumerate(value if isinstance(value, (tuple, list)) else [value]):
            dims = token_dims(fake)
            if dims and 0 not in dims:
                raise ForwardRefused(
                    f"piecewise: splitting op `{op_name(node.target)}` at {user_line(node)} returns output {index} "
                    f"of shape {tuple(fake.shape)}, with the tokens in dimension {dims[0]}, not 0; piecewise pads and "
                    f"cuts dimension 0: return it tokens-first (.transpose(0, {dims[0]}) inside the op, and back "
                    f"outside it)", "token_layout", node_stack(node))


def placeholder_values(module: torch.fx.GraphModule) -> list[Any]:
    """The example (fake) values of a graph's inputs, in order."""
    return [node.meta.get("example_value") for node in module.graph.nodes if node.op == "placeholder"]


def output_values(module: torch.fx.GraphModule) -> Any:
    """The example (fake) values of a graph's output, in its structure."""
    output = next(node for node in reversed(module.graph.nodes) if node.op == "output")
    return torch.fx.node.map_arg(output.args[0], lambda node: node.meta.get("example_value"))


def user_line(node: torch.fx.Node) -> str:
    """``file:line`` of the model code that made ``node`` (its innermost frame), or "" when unknown."""
    frames = node_stack(node)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def node_place(node: torch.fx.Node) -> str:
    """``file:line (`code`)`` of the model line that made ``node``, or "an unknown line"."""
    import linecache

    where = user_line(node)
    if not where:
        return "an unknown line"
    path, _, line = where.rpartition(":")
    code = linecache.getline(path, int(line)).strip()
    return where + (f" (`{code}`)" if code else "")


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
        if method_name(node) in _ALONG_DIM:
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
            source = node.args[0].meta.get("example_value") if isinstance(node.args[0], torch.fx.Node) else None
            if isinstance(dim, int) and isinstance(source, torch.Tensor) and source.dim() > 0:
                if dim % source.dim() in _token_dims(source):
                    found.append(node)
    return found
