"""A forward's output as piecewise walks it: tensors inside pytree containers (tuples, lists, dicts, transformers'
``ModelOutput``) and dataclass instances, which torch's pytree takes as single leaves."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch


def map_outputs(fn: Any, output: Any) -> Any:
    """``fn`` applied to each tensor of ``output`` inside pytree containers and dataclass instances (SGLang's
    ``LogitsProcessorOutput``; a copy with the fields mapped, frozen ones too); other leaves as they are."""
    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            made = copy.copy(value)
            for field in dataclasses.fields(value):
                object.__setattr__(made, field.name, torch.utils._pytree.tree_map(leaf, getattr(value, field.name)))
            return made
        return value

    return torch.utils._pytree.tree_map(leaf, output)


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of ``output`` in ``map_outputs``' order (dataclass fields included)."""
    found: list[torch.Tensor] = []
    map_outputs(lambda tensor: found.append(tensor) or tensor, output)
    return found


def unmapped_leaves(output: Any) -> list[tuple[str, Any]]:
    """What ``map_outputs`` does not map, as (name, value): leaves other than tensors, containers and dataclasses,
    and the values of a dataclass's attributes that are not its fields (set in ``__post_init__``: not cut)."""
    found: list[tuple[str, Any]] = []

    def leaf(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            names = {field.name for field in dataclasses.fields(value)}
            for name in names:
                torch.utils._pytree.tree_map(leaf, getattr(value, name))
            found.extend((f"{type(value).__name__}.{key}", item)
                         for key, item in getattr(value, "__dict__", {}).items() if key not in names)
        elif not isinstance(value, torch.Tensor):
            found.append((type(value).__name__, value))
        return value

    torch.utils._pytree.tree_map(leaf, output)
    return found
