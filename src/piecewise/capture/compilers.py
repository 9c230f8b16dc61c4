"""Per-piece compilers: turn one piece (an FX graph) into a callable, once, for the symbolic token size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _compat


class PieceCompiler:
    """Interface: ``compile(graph, example_inputs)`` returns a callable taking the piece's inputs."""

    name = "base"

    def compile(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        raise NotImplementedError


class EagerCompiler(PieceCompiler):
    """The FX graph as is: no fusion, but capture and replay still remove launch overhead."""

    name = "eager"

    def compile(self, graph, example_inputs):
        return graph.forward  # bound forward: no nn.Module call overhead


class InductorCompiler(PieceCompiler):
    """Inductor, compiled once for the symbolic token dimension (fake inputs carry the symbol)."""

    name = "inductor"

    def compile(self, graph, example_inputs):
        # compile_fx restores the graph's own output structure (a single tensor stays a single tensor).
        return _compat.compile_with_inductor(graph, example_inputs)


def piece_key(graph: torch.fx.GraphModule) -> tuple | None:
    """A key equal for two pieces that compute the same function of their inputs: the same ops (by identity) in the
    same order on the same argument positions and constants, inputs of the same shapes, strides, storage offsets
    (symbolic where the token count is), dtypes and devices. The layers of a model split into pieces of equal keys
    but for the first and last. ``None`` (never shared) for a piece that reads attributes or submodules of its own
    (two of them could hold other tensors under one name) or has a constant whose repr is an address."""
    position: dict[torch.fx.Node, int] = {}
    parts: list[tuple] = []

    def constant(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return ("%", position[value])
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(constant(item) for item in value))
        if isinstance(value, dict):
            return ("dict", tuple((repr(key), constant(item)) for key, item in value.items()))
        text = repr(value)
        if " at 0x" in text:
            raise LookupError(text)
        return (type(value).__qualname__, text)

    try:
        for node in graph.graph.nodes:
            position[node] = len(position)
            if node.op in ("get_attr", "call_module"):
                return None
            if node.op == "placeholder":
                value = node.meta.get("example_value", node.meta.get("val"))
                if isinstance(value, torch.Tensor):
                    parts.append(("tensor", tuple(map(str, value.shape)), tuple(map(str, value.stride())),
                                  str(value.storage_offset()), value.dtype, value.device))
                elif value is None:
                    return None
                else:
                    parts.append(constant(value))
            else:
                target = node.target if node.op == "call_function" else str(node.target)
                parts.append((node.op, target, constant(node.args), constant(node.kwargs)))
    except LookupError:
        return None
    return tuple(parts)


class SharedCompiles:
    """Compiles each distinct piece once: a piece whose ``piece_key`` equals an earlier one's (a model's layers)
    takes that piece's compiled callable, as Inductor's own cache would give it after a lookup, without the
    lookup. The eager compiler needs no sharing."""

    def __init__(self, compiler: PieceCompiler):
        self.compiler = compiler
        self.name = compiler.name
        self.compiled: dict[tuple, Callable] = {}
        self.shared = 0
        """Pieces that took an earlier piece's compiled callable."""

    def compile(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        if self.compiler.name == "eager" or _inductor_freezes():
            return self.compiler.compile(graph, example_inputs)  # frozen: the parameters are in the compiled code
        key = piece_key(graph)
        if key is None:
            return self.compiler.compile(graph, example_inputs)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.compiled[key] = self.compiler.compile(graph, example_inputs)
        else:
            self.shared += 1
        return compiled


COMPILERS: dict[str, type[PieceCompiler]] = {cls.name: cls for cls in (EagerCompiler, InductorCompiler)}
"""Compiler name (``config.COMPILERS`` lists them) → its class."""


def _inductor_freezes() -> bool:
    try:
        from torch._inductor import config
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return bool(getattr(config, "freezing", False))


def make_compiler(name: str) -> SharedCompiles:
    try:
        return SharedCompiles(COMPILERS[name]())
    except KeyError:
        raise ValueError(f"unknown piece compiler {name!r}; choose one of {sorted(COMPILERS)}") from None
