"""A forward's output as piecewise walks it: tensors inside pytree containers (tuples, lists, dicts, transformers'
``ModelOutput``) and dataclass instances, which torch's pytree takes as single leaves; and the tensors anywhere
inside an object (``walk_tensors``: arguments, module attributes, output objects)."""

from __future__ import annotations

import collections
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


def padded_dim(value: torch.Tensor, size: int) -> int | None:
    """The dimension of a tensor that is the padded token count ``size``, where no trace says which: the first, or
    the second behind a batch of one ([1, T, ...]: transformers' and gpt-fast's activations); None where neither."""
    if value.dim() > 0 and value.shape[0] == size:
        return 0
    if value.dim() > 1 and value.shape[0] == 1 and value.shape[1] == size:
        return 1
    return None


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


_BUDGET = 10_000
"""Objects ``walk_tensors`` visits below one value before it gives up on what lies deeper."""


def object_fields(value: Any) -> dict[str, Any]:
    """An object's attributes: ``__dict__`` and ``__slots__`` (a single name or names; private ones mangled)."""
    fields = dict(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        slots = getattr(cls, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{cls.__name__.lstrip('_')}{name}"
            if name not in fields and name not in ("__dict__", "__weakref__") and hasattr(value, name):
                fields[name] = getattr(value, name)
    return fields


def walk_tensors(value: Any, path: str = ""):
    """(path, tensor) for each tensor inside ``value``'s lists, tuples, dicts and objects' attributes, breadth first;
    (path, None) where more objects lie below than the walk's budget."""
    queue, seen, walked = collections.deque([(path, value)]), set(), 0
    while queue:
        path, value = queue.popleft()
        if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None), type, torch.nn.Module)):
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield path, value
            continue
        walked += 1
        if walked > _BUDGET:
            yield path, None
            return
        if isinstance(value, dict):
            queue += [(f"{path}[{key!r}]", item) for key, item in value.items()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            queue += [(f"{path}[{index}]", item) for index, item in enumerate(value)]
        else:
            queue += [(f"{path}.{key}", item) for key, item in object_fields(value).items()]
