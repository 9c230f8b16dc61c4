"""What a later call must share with the first call for the graphs to serve it, checked on every call.

- The global state the kernels were captured under: autocast (on, off, its dtype), the default dtype, TF32 and
  reduced-precision reductions, deterministic algorithms (Dynamo's own global-state guard, a fraction of a
  microsecond). A change of the thread count changes no kernel and is taken as it is.
- The model's train/eval mode, and its Python forward hooks (``hooks.HookState``: added or removed since).
- Each argument's kind: a tensor's dtype, device and layout (a static tensor's shape and strides too, since the
  graphs read it in place; a token tensor's sizes but its token dimension's, since its buffers have the first
  call's), a Python argument's value (numbers, strings, flags, None). Any other object, where
  replays run no Python (breakable), by what its fields hold: the tensors in it by address and shape, its numbers
  by value, so that attention metadata passed as an object and updated in place between calls is seen, and a new
  object holding the same buffers replays; with Dynamo, whose guards check it and whose bytecode reads its fields on
  every call, as Dynamo does.

A call that differs runs the model's own forward, without padding or graphs (right, and slower), with one warning
per distinct difference naming it. Parameters replaced or moved are ``ParameterWatch``'s (an error: compile again).
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import warnings
from typing import Any

import torch

from .. import _compat
from .hooks import HookState

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


_READS_TRAINING: dict[type, bool] = {}


def _reads_training(cls: type) -> bool:
    """Whether a module class's own code (its classes below ``nn.Module``: methods, properties, decorated functions
    unwrapped, nested functions and comprehensions; ``train`` and ``eval`` left out) reads ``training``."""
    found = _READS_TRAINING.get(cls)
    if found is None:
        codes = [code for klass in cls.__mro__ if klass not in (torch.nn.Module, object)
                 for key, value in list(vars(klass).items()) if key not in ("train", "eval")  # (they set it)
                 for code in _codes(value)]
        found = _READS_TRAINING[cls] = any(_names_training(code) for code in codes)
    return found


def _codes(value: Any) -> list[Any]:
    """The code objects behind a class attribute (a function, a property's accessors, a static or class method, a
    ``functools`` wrapper), none for anything else."""
    try:
        if isinstance(value, property):
            return [code for part in (value.fget, value.fset) if part is not None for code in _codes(part)]
        if not isinstance(value, types.FunctionType):  # staticmethod, classmethod, partialmethod, cached_property
            inner = getattr(value, "__func__", None) or getattr(value, "func", None)
            return _codes(inner) if inner is not None and inner is not value else []
        function = inspect.unwrap(value)
        return [function.__code__] if isinstance(function, types.FunctionType) else []
    except Exception:  # noqa: BLE001 - an object whose attributes misbehave (a proxy, a lazy module) holds no code
        return []


def _names_training(code: Any) -> bool:
    """Whether ``code`` or a code object nested in it reads ``training`` (``self.training``, ``getattr(self,
    "training")``)."""
    return "training" in code.co_names or "training" in code.co_consts or any(
        _names_training(inner) for inner in code.co_consts if isinstance(inner, types.CodeType))


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


class CallGuard:
    """The first call's global state, mode and argument kinds; ``difference(arguments)`` names what a call changed."""

    def __init__(self, model: torch.nn.Module, user_shape: Any = lambda name, shape: tuple(shape)):
        self.model = model
        self.user_shape = user_shape
        """(argument name, shape tokens-first) → the shape in the argument's own layout, for messages."""
        self.global_state: Any = None
        self.training: bool | None = None
        self.modes: list[tuple[str, torch.nn.Module, bool]] = []
        """Submodules whose code reads ``self.training`` (dropout, batch norm), with their mode at the first call;
        their modules and modes apart too, compared as two lists on every call."""
        self.mode_modules: list[torch.nn.Module] = []
        self.mode_flags: list[bool] = []
        self.hooks: HookState | None = None
        self.expected: dict[str, tuple] = {}
        self.warned: set[str] = set()

    def record(self, arguments: dict[str, Any], token_names: list[str], deep: bool) -> None:
        """Take the first call's (inside ``torch.inference_mode()``, like every later check). ``deep``: compare
        objects by their fields (the graphs read what they held at capture), not by identity."""
        self.global_state = _compat.global_state_guard()
        self.training = self.model.training
        self.modes = [(name, module, module.training) for name, module in self.model.named_modules()
                      if name and _reads_training(type(module))]
        self.mode_modules, self.mode_flags = [m for _, m, _ in self.modes], [t for _, _, t in self.modes]
        self.hooks = HookState(self.model)
        self.expected = {name: _kind(value, name in token_names, deep) for name, value in arguments.items()
                         if value is not None}

    def difference(self, arguments: dict[str, Any]) -> str | None:
        """What this call changed that the graphs depend on, or None. An argument left out and one given as None
        are the same call."""
        if self.global_state is None:
            return None
        if not self.global_state.check():
            reason = " ".join(self.global_state.reason().split())
            if set(reason.replace(",", " ").split()) <= _compat.BENIGN_GLOBAL_STATE:
                self.global_state = _compat.global_state_guard()
            else:
                return f"the global state changed since the first call ({reason}: autocast, the default dtype, " \
                       f"TF32 or deterministic algorithms)"
        hooks = self.hooks.change()
        if hooks is not None:
            return hooks
        if self.model.training is not self.training:
            return f"the model is in {'train' if self.model.training else 'eval'} mode now and was in " \
                   f"{'train' if self.training else 'eval'} mode at the first call"
        if [module.training for module in self.mode_modules] != self.mode_flags:  # `model.layers[0].train()`:
            name, module, training = next(m for m in self.modes if m[1].training is not m[2])  # replays keep the
            return f"submodule `{name}` is in {'train' if module.training else 'eval'} mode now and was in " \
                   f"{'train' if training else 'eval'} mode at the first call"  # capture's (a dropout left out)
        expected = self.expected
        given = 0
        for name, value in arguments.items():
            if value is None:
                continue
            want = expected.get(name)
            if want is None:
                return f"argument {name!r} is given now and was not at the first call"
            given += 1
            if type(value) is torch.Tensor or isinstance(value, torch.Tensor):
                if want[0] != "tensor" or value.dtype != want[1] or value.device != want[2] or \
                        value.layout != want[3] or (want[4] is not None and (value.shape, value.stride()) != want[4]):
                    return _describe(name, want, value)
                if want[4] is None and (value.dim() != len(want[5]) or value.shape[1:] != want[5][1:]):
                    return self._describe_rows(name, want[5], value)
            elif want[0] == "object":
                if fingerprint(value) != want[2]:
                    return _describe_object(name, want, value)
            elif want[0] == "traced":
                continue  # Dynamo guards the object itself, and its bytecode reads its fields on every call
            elif want[0] == "tensor" or not (value is want[1] or (want[2] and value == want[1])):
                return _describe(name, want, value)
        if given != len(expected):
            missing = next(name for name in expected if arguments.get(name) is None)
            return f"argument {missing!r} was given at the first call and is not now"
        return None

    def _describe_rows(self, name: str, first: tuple, value: torch.Tensor) -> str:
        if value.dim() != len(first):
            return f"argument {name!r} has {value.dim()} dimensions, shape {tuple(value.shape)}, and had " \
                   f"{len(first)} at the first call, shape {self.user_shape(name, first)}"
        was, now = self.user_shape(name, first), self.user_shape(name, tuple(value.shape))
        order = self.user_shape(name, tuple(range(len(first))))  # own dimension → dimension tokens-first
        changed = next(d for d in range(1, len(first)) if first[d] != value.shape[d])
        dim, token_dim = order.index(changed), order.index(0)
        # batch-first taken, one row in dimension 0 at first, or ids of a batch ([B, T] integers: transformers')
        hint = f"; if dimension {dim} carries the tokens, pass dynamic={{{name!r}: {dim}, ...}}" \
            if token_dim != 0 or first[0] == 1 or (len(first) == 2 and not value.is_floating_point()) else ""
        return f"argument {name!r} has shape {now} and had {was} at the first call (dimension {dim}); its token " \
               f"dimension is {token_dim}, the only one the graphs serve other sizes of" + hint

    def warn_once(self, difference: str) -> None:
        kind = re.sub(r"\d+", "#", difference)  # a number that changes every call (a length) warns once
        if kind in self.warned:
            return
        self.warned.add(kind)
        warnings.warn(
            f"piecewise: {difference}. The graphs were captured for the first call's, so such calls run the model's "
            f"own forward, without CUDA graphs (the same numbers as eager, slower). Call it as at the first call, or "
            f"compile a separate runner for this variant; a value that changes from call to call (a length, a step) "
            f"must reach the forward as a tensor, or be read only inside a splitting op "
            f"(piecewise.opaque_op(..., split=True)).", stacklevel=3)


def _kind(value: Any, token: bool, deep: bool) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.device, value.layout, None if token else (value.shape, value.stride()),
                tuple(value.shape) if token else None)
    if not _plain(value):
        return ("object", value, fingerprint(value)) if deep else ("traced", value, False)
    return ("python", value, True)


def fingerprint(value: Any, depth: int = 3) -> Any:
    """What a replay depends on of a Python object: tensors by address, shape, strides, dtype and device, numbers and
    flags by value, containers and objects' fields (``__dict__``, ``__slots__``) by theirs, ``depth`` levels down."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype, value.device)
    if _plain(value):
        return value
    if depth == 0 or isinstance(value, torch.nn.Module):
        return ("object", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(fingerprint(v, depth - 1) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((key, fingerprint(v, depth - 1)) for key, v in value.items()))
    fields = getattr(value, "__dict__", None)
    if fields is None:
        slots = [name for cls in type(value).__mro__ for name in getattr(cls, "__slots__", ())]
        fields = {name: getattr(value, name) for name in slots if hasattr(value, name)} if slots else None
    if fields is None:
        return ("object", id(value))
    return (type(value), tuple((key, fingerprint(v, depth - 1)) for key, v in fields.items()))


def _describe_object(name: str, want: tuple, value: Any) -> str:
    changed = _changed_fields(want[2], fingerprint(value))
    if len(changed) == 1 and _moved_tensor(*changed[0][1:]):  # only a tensor object is new: its values may be equal
        return f"argument {name!r} holds another tensor in field `{changed[0][0]}` than at the first call (the same " \
               f"shape and dtype at another address), and the graphs read the one it held then"
    field = changed[0][0] if changed else None
    return f"argument {name!r} holds other values than at the first call" + (f" (field `{field}`)" if field else "") \
        + (", which the forward may read: a breakable replay runs none of its Python, so an argument object's fields "
           "are all compared, read or not (pass the forward only what it reads, as tensors where they change)"
           if field else "")


def _moved_tensor(old: Any, new: Any) -> bool:
    return isinstance(old, tuple) and isinstance(new, tuple) and old[:1] == new[:1] == ("tensor",) and \
        old[2:] == new[2:]


def _changed_fields(was: Any, now: Any) -> list[tuple[str, Any, Any]]:
    """The fields of an object whose fingerprints differ (name, fingerprint then, now), where both are one object's
    fields."""
    if not (isinstance(was, tuple) and isinstance(now, tuple) and len(was) == len(now) == 2 and was[0] is now[0]):
        return []
    try:
        old, new = dict(was[1]), dict(now[1])
    except (TypeError, ValueError):
        return []
    return [(str(key), old.get(key), new.get(key)) for key in {**old, **new} if old.get(key) != new.get(key)]


def _describe(name: str, want: tuple, value: Any) -> str:
    if want[0] != "tensor":
        was = repr(want[1]) if want[2] else f"a {type(want[1]).__name__} object"
        now = repr(value) if _plain(value) else f"another {type(value).__name__} object"
        return f"argument {name!r} is {now} and was {was} at the first call"
    if not isinstance(value, torch.Tensor):
        return f"argument {name!r} is a {type(value).__name__} and was a tensor at the first call"
    for what, was, now in (("dtype", want[1], value.dtype), ("device", want[2], value.device),
                           ("layout", want[3], value.layout)):
        if was != now:
            cast = f" (cast it: {name}.to({was}) gives the graphs' dtype and the same values; gpt-fast's sampler " \
                f"returns int32 tokens)" if what == "dtype" and not was.is_floating_point and not was.is_complex \
                and was != torch.bool and not now.is_floating_point and not now.is_complex and now != torch.bool else ""
            return f"argument {name!r} has {what} {now} and had {was} at the first call{cast}"
    return f"argument {name!r} has shape {tuple(value.shape)} and strides {value.stride()}, and had " \
           f"{tuple(want[4][0])} and {want[4][1]} at the first call"


def summary(value: Any, depth: int = 3) -> Any:
    """What a trace depends on of a value, comparable and short to print: tensors by dtype, device and shape (not
    contents or address), numbers, strings and flags by value, containers and objects' fields ``depth`` levels down."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.device.type, tuple(value.shape))
    if isinstance(value, (*_PLAIN, enum.Enum)):
        return value
    if depth == 0 or isinstance(value, torch.nn.Module):
        return ("object", type(value).__name__)
    if isinstance(value, (list, tuple)):
        return ("items", type(value).__name__, tuple(summary(v, depth - 1) for v in value))
    if isinstance(value, dict):
        return ("fields", "dict", tuple((key, summary(v, depth - 1)) for key, v in value.items()))
    from ..capture.outputs import object_fields  # capture imports runtime's siblings only through this call

    fields = object_fields(value)
    if not fields:
        return ("object", type(value).__name__)
    return ("fields", type(value).__name__, tuple((key, summary(v, depth - 1)) for key, v in fields.items()))


def summary_difference(was: Any, now: Any, path: str) -> str | None:
    """``path.field[index]: before -> now`` for the first place two ``summary``s differ, or None."""
    if was == now:
        return None
    kinds = {type(v) is tuple and len(v) == 3 and v[0] in ("items", "fields") and v[0] for v in (was, now)}
    if len(kinds) == 1 and False not in kinds and was[1] == now[1]:
        if was[0] == "items":
            if len(was[2]) != len(now[2]):
                return f"{path}: {len(was[2])} items -> {len(now[2])}"
            places = [(f"{path}[{i}]", a, b) for i, (a, b) in enumerate(zip(was[2], now[2]))]
        else:
            old, new = dict(was[2]), dict(now[2])
            sub = "{path}[{key!r}]" if was[1] == "dict" else "{path}.{key}"
            places = [(sub.format(path=path, key=key), old.get(key, NOT_SET), new.get(key, NOT_SET))
                      for key in {**old, **new}]
        return next((found for place, a, b in places if (found := summary_difference(a, b, place))), None)
    return f"{path}: {_shown(was)} -> {_shown(now)}"


class _NotSet:
    def __repr__(self) -> str:
        return "not set"


NOT_SET = _NotSet()
"""A field or argument one side of a ``summary_difference`` lacks."""


def _shown(value: Any) -> str:
    if type(value) is tuple and value and value[0] == "tensor":
        return f"{str(value[1]).removeprefix('torch.')} tensor {list(value[3])} on {value[2]}"
    if type(value) is tuple and value and value[0] in ("items", "fields", "object"):
        return f"a {value[1]}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
