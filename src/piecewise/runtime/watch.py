"""Parameters, buffers or submodules replaced after the first call, or given other memory (``.data = ...``,
``model.to()``): the graphs would read the old ones."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import _compat

_calls_in_progress: list = []  # watches whose model is inside a call (a forward may assign its own attributes)
_watched: "weakref.WeakSet[ParameterWatch]" = weakref.WeakSet()
_hooks: list = []  # torch's handles of the registration hooks below


def _on_registration(kind: str):
    def hook(module: torch.nn.Module, name: str, value: Any) -> None:
        # Dynamo traces a forward's own attribute assignments into this hook: nothing for it to see here.
        if torch.compiler.is_compiling() or _calls_in_progress or not _watched:
            return None
        for watch in list(_watched):
            if watch.replaced is None and module in watch.modules:
                prefix = next((n for n, m in watch.model.named_modules() if m is module), "")
                watch.replaced = f"{kind} `{prefix + '.' if prefix else ''}{name}` was replaced by a new object"
        return None

    return hook


class ParameterWatch:
    """Flags its model when a parameter, buffer or submodule is assigned a new object outside a call (torch's
    global registration hooks, installed once), or when any parameter or buffer has other memory than at the first
    call (``param.data = new``, ``model.to()``, ``.half()``: one C++ check of every address on CUDA builds)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.replaced: str | None = None
        self.modules: weakref.WeakSet = weakref.WeakSet()
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.addresses: _compat.Addresses | None = None

    def start(self) -> None:
        if not _hooks:
            modules = torch.nn.modules.module
            _hooks.append(modules.register_module_parameter_registration_hook(_on_registration("parameter")))
            _hooks.append(modules.register_module_buffer_registration_hook(_on_registration("buffer")))
            _hooks.append(modules.register_module_module_registration_hook(_on_registration("submodule")))
        self.modules = weakref.WeakSet(self.model.modules())  # by identity; a module dropped later drops out
        self.tensors = [*self.model.named_parameters(), *self.model.named_buffers()]
        self.addresses = _compat.Addresses([tensor for _, tensor in self.tensors])
        _watched.add(self)

    def check(self) -> None:
        """Raise ``ValueError`` when the model changed under the graphs."""
        if self.addresses is not None and not self.addresses.unchanged():
            moved = [name for (name, tensor), address in zip(self.tensors, self.addresses.pointers)
                     if tensor.data_ptr() != address]
            self.replaced = self.replaced or (
                f"the memory of {len(moved)} parameter(s) or buffer(s) changed (`{moved[0]}` first: "
                f"`.data = ...`, model.to(), .half() or .cuda())")
        if self.replaced is not None:
            raise ValueError(
                f"piecewise: {self.replaced} after the first call. The trace and the captured graphs read "
                f"parameters and buffers where they were, so they would go on computing with the old ones. Write "
                f"new values in place (param.copy_(new), model.load_state_dict(state) without assign=True), or "
                f"compile the model again."
            )

    def __enter__(self) -> None:
        _calls_in_progress.append(self)

    def __exit__(self, *exc_info) -> None:
        _calls_in_progress.pop()
