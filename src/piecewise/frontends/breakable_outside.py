"""Tensors a breakable forward reads from outside: not an argument, not the model's state, not made by the run.

A breakable replay runs no Python of the forward: its graphs, and the splitting ops between them, read the tensors
the capture read, where they were. A tensor the forward takes from a global or an object of its own (an engine's
forward context, a table built at import) would be read at its first-call address on every later call, though
the caller put a new tensor there (stale values, or freed memory). Dynamo re-reads such tensors at every call; the
breakable front-end refuses them at the first call, naming the op (or the compiled region, whose inputs are what
Dynamo lifted, globals included) and the line, where its runs are checked (``OutsideTensors``). Known: the run's arguments (to any depth of objects), the model's parameters, buffers and
tensor attributes (of its modules, inside any containers and objects), the front-end's static and staged
tensors, the splitting calls' buffers, and whatever an op of the run made.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_leaves

from ..capture.outputs import walk_tensors
from ..errors import ForwardRefused
from .breakable_steps import storage
from .user_frames import chain_text, user_chain

class OutsideTensors:
    """One checked run's known tensors (by storage), and the check of an op's inputs against them."""

    def __init__(self, frontend: Any, arguments: dict[str, Any]):
        self.frontend = frontend
        self.known: set[int] = {storage(t) for t in _tensors(arguments) if checkable(t)}

    def made(self, result: Any) -> None:
        """Note what an op of the run returned."""
        for value in op_leaves(result):
            if isinstance(value, torch.Tensor) and checkable(value):
                self.known.add(storage(value))

    def check(self, name: str, args: tuple, kwargs: dict | None, labels: list[str] | None = None) -> None:
        """Refuse an op (or a compiled region, ``labels`` naming its inputs) that reads a tensor from outside (see
        the module's docstring)."""
        for index, value in enumerate(op_leaves((args, kwargs or {}))):
            if not isinstance(value, torch.Tensor) or not checkable(value):
                continue
            pointer = storage(value)
            if pointer in self.known or self._kept(value, pointer):
                continue
            if pointer in self._modules(refresh=True):  # an attribute the forward assigned during this run
                continue
            where = chain_text(user_chain()[-1:]) or "an unknown line"
            if labels is not None and index < len(labels):
                where += f" (its input `{labels[index]}`)"
            raise ForwardRefused(
                f"piecewise: {name} at {where} reads a tensor of shape "
                f"{tuple(value.shape)} that is neither an argument of forward, nor a parameter, buffer or tensor "
                f"attribute of the model, nor made by the forward: a global or an object's attribute (an engine's "
                f"forward context, a table built at import). The breakable front-end replays without running the "
                f"forward's Python, so every later call would read this tensor where it is now, even after the "
                f"caller put another in its place. Pass it as an argument of forward, register it on a module "
                f"(register_buffer), or read it inside a splitting op (piecewise.opaque_op(..., split=True)). The "
                f"Dynamo front-end reads it anew at every call.",
                "frozen_value", user_chain(),
            )

    def _kept(self, value: torch.Tensor, pointer: int) -> bool:
        frontend = self.frontend
        return pointer in frontend.static or pointer in frontend.state.buffer_storages or \
            frontend.stager.owns(value) or pointer in self._modules(refresh=False)

    def _modules(self, refresh: bool) -> set[int]:
        """The model's tensors (kept on the front-end across runs; walked again where a tensor is not among them)."""
        if self.frontend.module_storages is None or refresh:
            self.frontend.module_storages = module_storages(self.frontend.model)
        return self.frontend.module_storages


def module_storages(model: torch.nn.Module) -> set[int]:
    """The storages of the model's tensors: its parameters, buffers and tensor attributes (a KV cache kept on a
    layer), at any depth of containers."""
    found = [t for module in model.modules()
             for t in _tensors({k: v for k, v in vars(module).items() if k != "_modules"})]
    return {storage(t) for t in found if checkable(t)}


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors anywhere inside ``value`` (modules are walked by their owner)."""
    return [tensor for _, tensor in walk_tensors(value) if tensor is not None]


def checkable(tensor: torch.Tensor) -> bool:
    """A plain tensor with memory of its own (not meta, not sparse, not a subclass whose storage is not its data)."""
    return type(tensor) in _PLAIN_TENSORS and not tensor.is_meta and tensor.layout is torch.strided


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
_LEAVES = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device, torch.memory_format, torch.layout})


def op_leaves(value: Any) -> list:
    """``tree_leaves(value)``, in its order, for what ops take and return (tensors and numbers in plain lists,
    tuples and dicts) without pytree's per-node dispatch; other containers (named tuples, registered nodes) through
    ``tree_leaves``. Runs for every op of every checked run."""
    found: list = []
    _collect(value, found)
    return found


def _collect(value: Any, found: list) -> None:
    kind = type(value)
    if kind is list or kind is tuple or kind is dict:
        for item in value.values() if kind is dict else value:
            if type(item) in _LEAVES or isinstance(item, torch.Tensor):
                found.append(item)
            else:
                _collect(item, found)
    elif isinstance(value, torch.Tensor) or (kind not in SUPPORTED_NODES and not isinstance(value, (tuple, dict))):
        found.append(value)
    else:
        found.extend(tree_leaves(value))


def refuse_python_values(tensor: torch.Tensor) -> None:
    """A tensor the forward builds from Python values (``torch.tensor(values)``): a replay keeps the capture's."""
    raise ForwardRefused(
        f"piecewise: `torch.tensor(...)` at {chain_text(user_chain()[-1:]) or 'an unknown line'} builds a tensor of "
        f"shape {tuple(tensor.shape)} from Python values inside forward. The breakable front-end replays without "
        f"running the forward's Python, so every later call would use the values of the capture, even where the "
        f"Python values it was built from change. Build it once outside forward and register it on a module "
        f"(register_buffer), compute it from tensors, or use the Dynamo front-end, whose code runs at every call.",
        "frozen_value", user_chain(),
    )
