"""The module attributes a breakable forward reads, and their reassignment after capture.

A replay runs no Python, so a value the forward reads from a module attribute (attention metadata an engine sets on
the module before each step, a flag) stays what it was at capture. ``AttributeReads.record`` runs the forward once
with each module's class swapped for a subclass that notes which plain attributes it reads, and where; from then
on, an assignment to one of them (``module.meta = ...``, seen by ``_compat.on_module_assignment``) makes the next
replay raise, naming the attribute and the line that reads it.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from ..capture.segment import in_runner_call
from .breakable_globals import PLAIN, GlobalReads, inside_opaque_op, same
from .user_frames import innermost_user_line, line_text

_READERS: dict[tuple[type, bool], type] = {}


def _reading_class(cls: type, settings: bool = False) -> type:
    """A subclass of ``cls`` noting the reads of its instances' plain attributes while ``_RECORDING``: a module's
    (its own and its class's defaults, ``flag = False``), or a settings object's fields (``settings``, a model's
    ``config``: its instance dict only; its class may have its own ``__getattribute__``)."""
    reader = _READERS.get((cls, settings))
    if reader is None:
        def __getattribute__(self, name):
            value = cls.__getattribute__(self, name) if settings else object.__getattribute__(self, name)
            own = name in object.__getattribute__(self, "__dict__")
            kept = type(value) in PLAIN or isinstance(value, torch.Tensor)  # a field: a value, or a tensor by identity
            if (kept and own and bool(_RECORDING)) if settings else (
                    name not in _compat.MODULE_BOOKKEEPING and (own or (type(value) in _CLASS_DEFAULTS
                                                                      and not name.startswith("__")))):
                key = (id(self), name)
                if key not in _RECORDING[-1] and not inside_opaque_op(sys._getframe(1)):
                    _RECORDING[-1][key] = (self, value, innermost_user_line())
            return value

        reader = _READERS[(cls, settings)] = type(cls.__name__, (cls,), {
            "__getattribute__": __getattribute__, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return reader


def _settings(module: torch.nn.Module) -> list[Any]:
    """Plain Python objects a module holds as attributes (its ``config``, an options object): their fields are
    settings the forward may read."""
    return [value for name, value in vars(module).items() if not name.startswith("_")
            and hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
            and not callable(value) and type(value).__module__.split(".")[0] not in _NOT_SETTINGS
            and not hasattr(type(value), "__slots__")]


_NOT_SETTINGS = frozenset(sys.stdlib_module_names) | {"torch", "triton", "numpy"}
"""Packages whose objects a module may hold (a logger, a lock, a generator) that are not its settings."""


_RECORDING: list[dict] = []
_CLASS_DEFAULTS = (*PLAIN, types.MethodType)
"""What the class gives an instance that an instance's assignment overrides: a flag or a setting's default, a
method (``layer.post_attention = patched``: replays would go on running the method of the capture)."""


class AttributeReads:
    """The plain module attributes one run of a forward read, and which of them were assigned since."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.reads: dict[tuple[int, str], tuple[Any, Any, tuple[str, int] | None]] = {}
        """(id of the module, attribute) → (the module, the value read, where)."""
        self.assigned: list[tuple[Any, str]] = []
        self.own: set[tuple[int, str]] = set()
        """Attributes the forward assigns itself (a counter, a kept value): its own state, which
        ``warn_changed_state`` names; an eager call of the model assigning them is not a change of setting."""
        self.recording = False
        self.fields: list[tuple[Any, dict, str, Any]] = []
        """(settings object, its instance dict, field, value read) of each plain field of a module's settings object
        the run read (a ``config.window``): no assignment hook sees those, so every replayed call compares them."""
        self.globals = GlobalReads()
        """Plain values the forward's functions read from globals (``breakable_globals``), compared likewise."""

    def record(self, run: Callable[[], Any]) -> Any:
        """Run ``run()`` noting the reads, then start watching those attributes."""
        swapped = []
        _RECORDING.append({})
        self.recording = True
        _compat.on_module_assignment(self._noted)
        try:
            for module in self.model.modules():
                cls = type(module)
                if "__getattribute__" in vars(cls) or hasattr(cls, "__slots__"):
                    continue  # a class of its own making: left as it is
                try:
                    module.__class__ = _reading_class(cls)
                except TypeError:
                    continue
                swapped.append((module, cls))
            for holder in {id(h): h for module in self.model.modules() for h in _settings(module)}.values():
                try:  # past the class's own __setattr__ (a frozen dataclass refuses every assignment)
                    cls = type(holder)
                    object.__setattr__(holder, "__class__", _reading_class(cls, settings=True))
                except (TypeError, AttributeError):
                    continue
                swapped.append((holder, cls))
            return self.globals.record(run, {type(module).__module__ for module in self.model.modules()})
        finally:
            self.recording = False
            for module, cls in swapped:
                object.__setattr__(module, "__class__", cls)
            self.reads = _RECORDING.pop()
            self.fields = [(holder, object.__getattribute__(holder, "__dict__"), name, value)
                           for (_, name), (holder, value, _) in self.reads.items()
                           if not isinstance(holder, torch.nn.Module)]
            self.assigned.clear()
            _compat.on_module_assignment(self._assigned)

    def _noted(self, module: torch.nn.Module, name: str) -> None:
        if self.recording:
            self.own.add((id(module), name))

    def _assigned(self, module: torch.nn.Module, name: str) -> None:
        read = self.reads.get((id(module), name))
        if read is None or in_runner_call() or (id(module), name) in self.own:  # the forward's own assignments
            return
        value = vars(module).get(name)
        if value is read[1] or (isinstance(value, (int, float, bool, str)) and value == read[1]):
            return  # the same value again (an eager call of the model assigning what it had)
        self.assigned.append((module, name))

    def refresh(self) -> None:
        """After each run of the first call: the values its forward set itself (a field, a global) are the ones to
        keep; only a change after it is one the graphs would miss."""
        self.globals.refresh()
        self.fields = [(holder, fields, name, fields.get(name, _MISSING)) for holder, fields, name, _ in self.fields]

    def check(self) -> None:
        """Raise ``ValueError`` when an attribute the forward reads was assigned since it was recorded, or a field of
        a settings object it reads holds another value."""
        changed = next(((holder, name) for holder, fields, name, value in self.fields
                        if not same(fields.get(name, _MISSING), value)), None)
        if changed is None and not self.assigned:
            self.globals.check()
            return
        holder, name = changed or self.assigned[0]
        _, _, where = self.reads[(id(holder), name)]
        path = next((n for n, m in self.model.named_modules() if m is holder), None) if changed is None else next(
            (f"{n + '.' if n else ''}{attribute}" for n, m in self.model.named_modules()
             for attribute, value in vars(m).items() if value is holder), type(holder).__name__)
        raise ValueError(
            f"piecewise: `{path + '.' if path else ''}{name}` {'was assigned' if changed is None else 'changed'} "
            f"after the first call, and the forward reads it at {line_text(where)}. A replayed call runs no Python, "
            f"so its graphs would go on using what it held at capture. Pass the value to forward as an argument (a "
            f"tensor is read in place, any other value is checked on every call), read it inside a splitting op, or "
            f"compile again.")


_MISSING = object()
