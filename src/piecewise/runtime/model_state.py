"""The state a call of the model could write in place, beside its static tensor arguments; and ``Written``, which
puts back after the first call's rehearsals what they added to it."""

from __future__ import annotations

import functools
import sys
import types
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


def state_tensors(runner: Any, arguments: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a call could write in place, each with its name: the static tensor arguments and
    ``model_state``."""
    dynamic = runner.arguments.dynamic
    named = [(f"argument {name!r}", t) for name, t in arguments.items() if isinstance(t, torch.Tensor)
             and name not in dynamic]
    return writable(named + model_state(runner, arguments))


def global_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Tensors held by the globals of the files that define the model's classes (not torch's): a forward context's
    dict of recurrent states a splitting op finds by a layer's name, a table built at import."""
    named = []
    files = dict.fromkeys(type(m).__module__ for m in model.modules())
    for file in [f for f in files if f and f.split(".")[0] != "torch" and f in sys.modules]:
        for key, value in list(vars(sys.modules[file]).items()):
            if not key.startswith("__") and not isinstance(value, _NOT_STATE) \
                    and not type(value).__module__.startswith("piecewise"):  # a runner held in a global
                named += [(f"global `{file}.{path}`", t) for path, t in walk_tensors(value, key) if t is not None]
    return named


_NOT_STATE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
              functools.partial, torch.nn.Module)


class Written:
    """The first call runs the forward many times (the warm-up, the checks, a capture per size, the search's
    timing). A write that replaces (a KV cache's rows, a table built on first use) ends where one call would; one
    that adds (vLLM's expert-load count for EPLB, a step counter in a buffer) would hold every rehearsal's share.
    Taken before the warm-up: a copy of each state tensor (smallest first, within ``budget``); after it, what the
    warm-up wrote. ``put_back`` restores what it held before the call to each tensor the warm-up wrote and a later
    run wrote again (written on every run, so the call writes it once more); what only the warm-up wrote
    (built on first use) stays. A tensor too large to copy (a KV cache beyond the budget) is left as it is."""

    def __init__(self):
        self.copies, self.after, self.versions = [], None, []

    def take(self, runner: Any, arguments: dict[str, Any]) -> None:
        kept, room = [], {}
        state = writable(state_tensors(runner, arguments) + global_tensors(runner.model))
        for name, tensor in sorted(state, key=lambda nt: nt[1].numel()):
            size = 2 * tensor.numel() * tensor.element_size()  # the copy before, and the one after the warm-up
            if tensor.device.type == "meta" or size > room.setdefault(tensor.device, _budget(tensor.device)):
                continue
            room[tensor.device] -= size
            kept.append((name, tensor, tensor.clone()))
        self.copies, self.after = kept, None

    def warmed_up(self) -> None:
        self.copies = [(name, t, copy) for name, t, copy in self.copies if not same_bits(t, copy)]
        self.after = [t.clone() for _, t, _ in self.copies]
        self.versions = [_version(t) for _, t, _ in self.copies]

    def put_back(self, everything: bool = False) -> list[str]:
        """Restore the tensors written on every run (``everything``: each the warm-up wrote, a refused first call
        leaving no trace); their names."""
        names = []
        for (name, tensor, copy), after, version in zip(self.copies, self.after or [None] * len(self.copies),
                                                         self.versions or [None] * len(self.copies)):
            # Written again with the same value (a count kept, ``buf.fill_(x.shape[0])``) counts too: a forward
            # that reads it before writing must see what it held before the call, as eager's does.
            if everything or not same_bits(tensor, after) or (version is not None and _version(tensor) != version):
                tensor.copy_(copy)
                names.append(name)
        self.copies, self.after, self.versions = [], None, []
        return names


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's count of in-place writes; None for an inference tensor, which keeps none."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _budget(device: torch.device) -> int:
    """Bytes the copies may take: a quarter of the free memory on CUDA, 2 GiB elsewhere."""
    return torch.cuda.mem_get_info(device)[0] // 4 if device.type == "cuda" else 2 << 30


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a NaN equals itself; float8 has no ``==`` on every device)."""
    bits = _BITS.get(a.element_size()) if not a.is_complex() else None
    return bool(torch.equal(a.view(bits), b.view(bits)) if bits is not None else torch.equal(a, b))
