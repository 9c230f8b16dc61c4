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


COMPILERS: dict[str, type[PieceCompiler]] = {cls.name: cls for cls in (EagerCompiler, InductorCompiler)}
"""Compiler name (``config.COMPILERS`` lists them) → its class."""


def make_compiler(name: str) -> PieceCompiler:
    try:
        return COMPILERS[name]()
    except KeyError:
        raise ValueError(f"unknown piece compiler {name!r}; choose one of {sorted(COMPILERS)}") from None
