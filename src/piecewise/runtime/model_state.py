"""The state a call of the model could write in place, beside its static tensor arguments."""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from ..capture.outputs import walk_tensors


def model_state(runner: Any, arguments: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The state a call could write besides its static tensor arguments, each with its name: the tensors inside
    its other static arguments (a list of KV caches, an engine's batch object), the model's buffers, and the
    tensors its modules hold as plain attributes (vLLM's ``Attention.kv_cache``), parameters left out."""
    dynamic = runner.arguments.dynamic
    named = []
    for name, value in arguments.items():
        if value is not None and not isinstance(value, torch.Tensor) and name not in dynamic:
            named += [(f"`{name}{path}`", t) for path, t in walk_tensors(value) if t is not None]
    model = runner.model
    named += [(f"buffer `{name}`", t) for name, t in model.named_buffers()]
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for prefix, module in model.named_modules():
        for key, value in vars(module).items():
            if key not in _compat.MODULE_BOOKKEEPING:
                named += [(f"attribute `{prefix + '.' if prefix else ''}{path}`", t)
                          for path, t in walk_tensors(value, key) if t is not None
                          and t.untyped_storage().data_ptr() not in parameters]
    return writable(named)


def writable(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors an op could have written in place, each storage once: dense, no element aliased by another
    (an expanded view cannot be written, nor put back)."""
    seen, out = set(), []
    for name, tensor in named:
        if tensor.layout is not torch.strided or type(tensor) not in (torch.Tensor, torch.nn.Parameter) or any(
                stride == 0 and n > 1 for stride, n in zip(tensor.stride(), tensor.shape)):
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if key not in seen:
            seen.add(key)
            out.append((name, tensor))
    return out
