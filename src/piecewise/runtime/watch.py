"""Parameters, buffers or submodules replaced after the first call, or given other memory (``.data = ...``,
``model.to()``), layers added to or deleted from a container, a module class's ``forward`` patched: the trace and
the graphs would go on with the old ones."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import _compat

_calls_in_progress: list = []  # watches whose model is inside a call (a forward may assign its own attributes)
_watched: "weakref.WeakSet[ParameterWatch]" = weakref.WeakSet()
_hooks: list = []  # torch's handles of the registration hooks below
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


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
        self.containers: list[tuple[str, torch.nn.Module, dict, int, list | None]] = []
        self.forwards: list[tuple[type, Any]] = []

    def start(self) -> None:
        if not _hooks:
            modules = torch.nn.modules.module
            _hooks.append(modules.register_module_parameter_registration_hook(_on_registration("parameter")))
            _hooks.append(modules.register_module_buffer_registration_hook(_on_registration("buffer")))
            _hooks.append(modules.register_module_module_registration_hook(_on_registration("submodule")))
        self.modules = weakref.WeakSet(self.model.modules())  # by identity; a module dropped later drops out
        self.tensors = [*self.model.named_parameters(), *self.model.named_buffers()]
        self.addresses = _compat.Addresses([tensor for _, tensor in self.tensors])
        # ModuleList.__delitem__ and insert, and a reorder through `_modules`, pass no registration hook; a class's
        # forward patched is no attribute of the model: checked at every call, each container by its length, the
        # outermost ones (the layer stacks, not each layer's experts) by their layers' identity too, each class's
        # forward by identity (about a µs for a 16-layer model).
        containers = [(name, module) for name, module in self.model.named_modules() if isinstance(module, _CONTAINERS)]
        outer = {name for name, _ in containers if not any(name.startswith(other + ".") for other, _ in containers)}
        self.containers = [(name, module, module._modules, len(module._modules),
                            list(module._modules.values()) if name in outer else None) for name, module in containers]
        self.forwards = [(cls, cls.forward) for cls in dict.fromkeys(type(m) for m in self.model.modules())
                         if not issubclass(cls, torch.jit.ScriptModule)]  # (whose class has no plain forward)
        _watched.add(self)

    def check(self) -> None:
        """Raise ``ValueError`` when the model changed under the graphs."""
        if self.addresses is not None and not self.addresses.unchanged():
            moved = [name for (name, tensor), address in zip(self.tensors, self.addresses.pointers)
                     if tensor.data_ptr() != address]
            self.replaced = self.replaced or (
                f"the memory of {len(moved)} parameter(s) or buffer(s) changed (`{moved[0]}` first: "
                f"`.data = ...`, model.to(), .half() or .cuda())")
        if self.replaced is None:
            self.replaced = next((f"`{cls.__qualname__}.forward` was patched" for cls, forward in self.forwards
                                  if cls.forward is not forward), None) or next(
                (f"`{name}` had {count} layers at the first call and has {len(module._modules)} now"
                 if len(module._modules) != count else f"the layers of `{name}` were replaced or reordered"
                 for name, module, layers, count, children in self.containers
                 if module._modules is not layers or len(layers) != count
                 or (children is not None and list(layers.values()) != children)), None)  # (modules: by identity)
        if self.replaced is not None:
            raise ValueError(
                f"piecewise: {self.replaced} after the first call. The trace and the captured graphs keep the "
                f"model's code, layers, parameters and buffers as they were, so they would go on computing with the "
                f"old ones. Write new values in place (param.copy_(new), model.load_state_dict(state) without "
                f"assign=True), or compile the model again (after patching code or changing its layers)."
            )

    def __enter__(self) -> None:
        _calls_in_progress.append(self)

    def __exit__(self, *exc_info) -> None:
        _calls_in_progress.pop()
