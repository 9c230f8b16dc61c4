"""Tensors a custom op captured into a graph reads from outside its arguments, and the check that they still exist.

An op made with ``torch.library`` (not a splitting op) is captured with the pieces around it: its Python runs once,
at capture, and the graph keeps the addresses of whatever its kernel read. An op that takes per-call data from a
global (vLLM's KV-cache update reading ``slot_mapping`` from the forward context) has it frozen at the first call's
tensor: where the engine makes a new tensor every step, replays read the first one, or freed memory, and write the
wrong slots. No front-end's trace sees inside such an op (Dynamo keeps it opaque; breakable's dispatch mode is off
while an op runs), so piecewise looks while capturing: a dispatch mode around the captures runs each custom op's
kernel below itself with a second mode on the stack, which notes every tensor the op's own ops read that is not
among its arguments, not made inside it, not made by the forward, and not the model's own (its parameters, buffers
and tensor attributes).

Each is held by a weak reference to its storage (every view of one persistent buffer shares it, and it goes with
the buffer), and by where the op's module holds it: a path from the globals of the frame that read it
(``CTX["slots"]``, ``engine.forward_context._forward_context.attn_metadata.slot_mapping``; dicts, lists, objects'
attributes, the modules and functions named there). A later call finding the storage freed, or a tensor over another
storage at that path, runs the model's own forward with one warning: the graphs would read freed memory, or the
first call's values. Not seen: a Triton kernel launched from the op on a global it was not handed, a custom op with
no tensor argument, a tensor found at no path (reached through locals or a closure, or past the search's bounds)
that the caller replaces while keeping the old one alive, and Python numbers read from a global inside an op (they
are frozen at capture as well).
"""

from __future__ import annotations

import logging
import sys
import types
import weakref
from collections import deque
from dataclasses import dataclass
from functools import reduce
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..capture.segment import stream_capturing
from ..frontends.breakable_outside import checkable, module_storages, op_leaves
from ..frontends.breakable_steps import storage as storage_of
from ..frontends.user_frames import chain_text, innermost_user_frame, user_chain
from ..graph.split import is_custom_op

logger = logging.getLogger(__name__)

@dataclass
class OutsideRead:
    """A tensor a captured custom op read that is not among its arguments."""

    op: str
    where: str
    shape: tuple
    dtype: torch.dtype
    storage: weakref.ref
    """Its storage: one object for every view of one buffer, gone with the buffer."""
    path: tuple = ()
    """Where the op's module holds it: ``(name in roots, ("attr" | "item", key), ...)``; empty where not found."""
    roots: dict | None = None
    """The globals of the frame that read it."""

    def __str__(self) -> str:
        held = f" (held at `{_path_text(self.path, self.roots)}`)" if self.path else ""
        return (f"`{self.op}` at {self.where} reads a {tuple(self.shape)} {str(self.dtype).replace('torch.', '')} "
                f"tensor{held}")


def stale(reads: list[OutsideRead]) -> str | None:
    """Why the graphs can no longer serve a call, where a tensor a captured op read is freed or replaced."""
    for read in reads:
        storage = read.storage()
        if storage is None:
            what = "that tensor has been freed since the first call, so the graph would read freed memory"
        elif read.path and isinstance(now := _resolve(read.roots, read.path), torch.Tensor) and \
                now.layout is torch.strided and now.untyped_storage() is not storage:
            what = f"`{_path_text(read.path, read.roots)}` now holds another tensor, so the graph would read the " \
                   f"first call's values"
        else:
            continue
        return (f"piecewise: {read} that is not among its arguments (a global: an engine's forward context, a table), "
                f"and {what}: the op ran once, while its CUDA graph captured, and the graph reads the tensor it read "
                f"then. This call runs the model's own forward, without graphs, as does every call while it is so. "
                f"Pass the tensor to the "
                f"op as an argument, keep it in one buffer filled in place on every call (as vLLM's persistent "
                f"metadata buffers are), or make the op a splitting op (CaptureConfig(splitting_ops=[...])), which "
                f"runs every call.")
    return None


_MISSING = object()
_SEARCHED = 5000
"""Objects looked at, at most, to find where a read tensor is held (once per tensor, while capturing)."""


def _held_at(roots: dict, storage: Any) -> tuple:
    """The shortest path from ``roots`` (a frame's globals) to a tensor over ``storage``; () where none is found
    (within 6 steps and 5,000 objects; objects without ``__dict__`` are not entered): then only its freeing is
    seen."""
    try:
        return _search(roots, storage)
    except Exception:  # noqa: BLE001 - user objects answering isinstance or vars oddly: no path, never a failed capture
        return ()


def _search(roots: dict, storage: Any) -> tuple:
    queue = deque((value, (name,)) for name, value in list(roots.items()) if not name.startswith("__"))
    seen: set[int] = set()
    while queue and len(seen) < _SEARCHED:
        value, path = queue.popleft()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.layout is torch.strided and value.untyped_storage() is storage:
                return path
        elif len(path) < 6:
            queue.extend((child, (*path, step)) for step, child in _children(value, top=len(path) == 1))
    return ()


def _children(value: Any, top: bool) -> list:
    if isinstance(value, dict):
        return [(("item", k), v) for k, v in list(value.items())[:256] if isinstance(k, (str, int))]
    if isinstance(value, (list, tuple)):
        return [(("item", i), v) for i, v in enumerate(value[:256])]
    if isinstance(value, types.ModuleType):  # a module the op's module names: its globals, not the modules they name
        if not top or _library(value.__name__):
            return []
        return [(("attr", k), v) for k, v in list(vars(value).items()) if not k.startswith("__")]
    if isinstance(value, types.FunctionType):  # a function the op calls (get_forward_context): its module's globals
        if not top or _library(value.__module__ or "builtins"):
            return []
        return [(("global", k), v) for k, v in list(value.__globals__.items()) if not k.startswith("__")]
    if isinstance(value, (type, types.BuiltinFunctionType, types.MethodType, str, bytes)):
        return []
    attributes = getattr(value, "__dict__", None)
    return [(("attr", k), v) for k, v in list(attributes.items())] if isinstance(attributes, dict) else []


def _library(module: str) -> bool:
    root = module.partition(".")[0]
    return root in ("torch", "piecewise", "triton", "numpy", "builtins") or root in sys.stdlib_module_names


def _resolve(roots: dict | None, path: tuple) -> Any:
    try:
        value = roots[path[0]]
        for kind, key in path[1:]:
            value = value[key] if kind == "item" else value.__globals__[key] if kind == "global" else vars(value)[key]
        return value
    except Exception:  # noqa: BLE001 - not there now (a context set only around some calls): nothing to compare
        return _MISSING


def _path_text(path: tuple, roots: dict | None) -> str:
    """``CTX['slots']``; through a function's module: ``engine.forward_context._context.slot_mapping``."""
    steps = list(path[1:])
    text = path[0]
    if steps and steps[0][0] == "global":
        text = f"{getattr(roots.get(path[0]) if roots else None, '__module__', path[0])}.{steps.pop(0)[1]}"
    return text + "".join(f".{key}" if kind == "attr" else f"[{key!r}]" for kind, key in steps)


def _storages(value: Any) -> list[int]:
    """The storages of the plain tensors among an op's arguments or results."""
    return [storage_of(t) for t in op_leaves(value) if isinstance(t, torch.Tensor) and checkable(t)]


class Watch(TorchDispatchMode):
    """Around the captures (``watching``): sees every op the forward runs, notes what it made, and runs custom ops
    captured into a graph under ``_Inside``."""

    supports_higher_order_operators = True  # torch.cond and the like pass through as they are

    def __init__(self, known: set[int], splitting: frozenset[str], always: bool = False):
        super().__init__()
        self.known, self.splitting, self.always = known, splitting, always
        self.reads: dict[int, OutsideRead] = {}
        self.custom: dict[Any, bool] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled code keeps running compiled (and Dynamo marks no frame to be skipped)

    def is_custom(self, func) -> bool:
        custom = self.custom.get(func)
        if custom is None:
            custom = self.custom[func] = isinstance(func, torch._ops.OpOverload) and \
                is_custom_op(func._schema.name, self.splitting)
        return custom

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = self.run(func, args, kwargs)
        if self.always:  # the doctor's one run: what the forward made (and may keep in a global) is not news
            self.known.update(_storages(result))
        return result

    def run(self, func, args: tuple, kwargs: dict) -> Any:
        """One op of the forward: a custom op captured into a graph (or, ``always``, any custom op) under ``_Inside``,
        any other as it is. Breakable's interceptor calls this itself, in place of a second mode on the stack."""
        if self.is_custom(func) and (self.always or stream_capturing()):
            return self.inside(func, args, kwargs, set())
        return func(*args, **kwargs)

    def inside(self, func, args: tuple, kwargs: dict, local: set[int]) -> Any:
        """Run a custom op's kernel below the Python key, so that its own ops dispatch anew, through ``_Inside``
        (``local``: what the op that calls this one was handed or made, shared with it)."""
        tensors = [v for v in op_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        if not tensors:
            return func(*args, **kwargs)
        keys = reduce(lambda a, b: a | b, (torch._C._dispatch_keys(t) for t in tensors))
        below = keys & torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)
        local.update(_storages(tensors))
        with _Inside(self, func._schema.name, local):
            return func.redispatch(below, *args, **kwargs)


class _Inside(TorchDispatchMode):
    """While one custom op's kernel runs: each tensor its ops read that the op was not handed nor made."""

    supports_higher_order_operators = True

    def __init__(self, watch: Watch, op: str, handed: set[int]):
        super().__init__()
        self.watch, self.op, self.local = watch, op, handed

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in op_leaves((args, kwargs)):
            if isinstance(value, torch.Tensor) and checkable(value) and (pointer := storage_of(value)) not in \
                    self.local and pointer not in self.watch.known:
                self._note(value)
                self.local.add(pointer)
        if self.watch.is_custom(func):  # a custom op this one calls: its own ops are watched the same way
            result = self.watch.inside(func, args, kwargs, self.local)
        else:
            result = func(*args, **kwargs)
        self.local.update(_storages(result))
        return result

    def _note(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if id(storage) not in self.watch.reads:
            where = chain_text(user_chain()[-1:]) or "an unknown line"
            frame = innermost_user_frame()
            roots = frame.f_globals if frame is not None else None
            self.watch.reads[id(storage)] = OutsideRead(self.op, where, tuple(tensor.shape), tensor.dtype,
                                                        weakref.ref(storage), _held_at(roots or {}, storage), roots)


def watching(model: torch.nn.Module, splitting: frozenset[str], always: bool = False) -> Watch:
    """The mode to enter around the captures. The model's parameters, buffers and tensor attributes (a KV cache kept
    on its layer, as vLLM's) are its own state, known: parameters and buffers are watched on every call
    (``runtime/watch.py``). ``always``: every custom op's reads, captured or not (the doctor's eager run)."""
    return Watch(module_storages(model), splitting, always)


def doctor_warnings(watch: Watch) -> list[str]:
    """The doctor's reading of what custom ops took from outside their arguments in its eager run."""
    return [f"{read} that is not among its arguments (a global: an engine's forward context, a table). Captured "
            f"into a graph (a custom op that is not a splitting op and whose result is used), the op runs once and "
            f"the graph reads this tensor at every call: an engine that puts a new tensor there each step makes "
            f"piecewise run the model's own forward (no graphs) from then on. Pass it to the op as an argument, keep "
            f"one buffer filled in place, or make the op a splitting op." for read in watch.reads.values()]


def settle(watch: Watch) -> list[OutsideRead]:
    """What the captures read from outside, logged once. Captures do not note what the forward made (one Python
    step less per op of every capture): a tensor of the forward a captured op read through a global was the graph's
    own, gone once the captures end, or is still held there, where no later call (no Python runs) replaces it."""
    reads = [read for read in watch.reads.values() if read.storage() is not None]
    for read in reads:
        logger.info("piecewise: %s that is not among its arguments; its graphs read it where it is now (a later call "
                    "finding it freed runs the model's own forward)", read)
    return reads
