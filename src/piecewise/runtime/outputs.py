"""Outputs piecewise cannot hand back right: tensors the forward made, inside an object that is not a container.

``Core.finish`` cuts each output tensor to the call's tokens and copies it out of the graphs' memory, walking
tuples, lists, dicts, pytree-registered classes (transformers' ``ModelOutput``) and dataclasses (``map_outputs``).
A tensor inside any other object (transformers' ``DynamicCache`` in ``past_key_values``, a dataclass of results) would come back with the
padded rows and in memory the next replay overwrites: refused at the first call, naming it and what to do. Such
an object that holds only the model's own tensors or the static arguments (a cache passed in and returned) is
served.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from ..errors import ForwardRefused

_DEPTH = 4


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


def _leaves(output: Any) -> list:
    """The leaves ``map_outputs`` does not map: objects other than tensors, containers and dataclasses."""
    found: list = []

    def note(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            found.append(value)
        return value

    def leaf(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                torch.utils._pytree.tree_map(leaf, getattr(value, field.name))
            return value
        return note(value)

    torch.utils._pytree.tree_map(leaf, output)
    return found


def _within(value: Any, path: str, depth: int, seen: set[int]):
    """(path, tensor) for each tensor inside ``value``'s lists, tuples, dicts and plain objects' attributes."""
    if id(value) in seen or depth < 0 or isinstance(value, (str, bytes, int, float, bool, type(None), type,
                                                           torch.nn.Module)):
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if isinstance(value, dict):
        items = [(f"{path}[{key!r}]", item) for key, item in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{index}]", item) for index, item in enumerate(value)]
    else:
        items = [(f"{path}.{key}", item) for key, item in getattr(value, "__dict__", {}).items()]
    for where, item in items:
        yield from _within(item, where, depth - 1, seen)


def refuse_made_tensors_in_objects(output: Any, kept: set[int]) -> None:
    """Refuse an output whose non-container objects hold tensors other than those in ``kept`` (storages of the
    model's tensors and the static arguments)."""
    for leaf in _leaves(output):
        name = type(leaf).__name__
        for path, tensor in _within(leaf, name, _DEPTH, set()):
            if tensor.device.type == "meta" or tensor.untyped_storage().data_ptr() in kept:
                continue
            raise ForwardRefused(
                f"piecewise: the output holds a {name} object with tensors the forward made ({path}, shape "
                f"{tuple(tensor.shape)}). piecewise cuts each output tensor to the call's tokens and copies it out of "
                f"the graphs' memory inside tuples, lists, dicts, dataclasses and ModelOutputs, not inside other "
                f"objects: this one "
                f"would come back with the padded rows, in memory the next call overwrites. Return the tensors "
                f"themselves, or leave the object out of the output (transformers: call with use_cache=False; for a "
                f"KV cache use piecewise.generate or integrations.token_model.TokenModel).",
                "output_object")
