"""Python forward hooks on the model's modules, named at the first call.

A hook runs where the module runs: on the padded rows of a call (an activation it keeps has the capture size's
rows, not the call's), and, once graphs replay, not at all with the breakable front-end (it runs no Python) or, with
Dynamo, replayed from its trace (a tensor it keeps lives in graph memory that the next call overwrites). A hook
that only changes its module's output is captured as it ran, and is right. Which kind a hook is cannot be told from
outside: the first call warns once, naming them.

Hooks added or removed after the first call are not in the graphs (nor in Dynamo's trace: torch does not guard
module hooks by default): ``HookState`` sees the change and ``CallGuard`` sends such calls to the model's own
forward, which runs them. Hooks on the compiled module itself never run inside a Dynamo trace of its forward
(``top_level_hooks``: the Dynamo front-end refuses them).
"""

from __future__ import annotations

import warnings

import torch
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from ..errors import ForwardRefused
from ..frontends.user_frames import caller_stacklevel
from .layout import inner


_QUIET = ("transformers.utils.output_capturing",)
"""Hooks that only collect what becomes part of the output (transformers' ``output_hidden_states``): the output's
tensors are cut and copied as any other."""


def warn_of_forward_hooks(model: torch.nn.Module) -> list[str]:
    """Warn once when the model's modules (or every module: global hooks) have Python forward hooks; returns
    them as ``module: hook``."""
    found = [f"{name or 'the model'}: {_name(hook)}" for name, module in inner(model).named_modules()
             for hooks in (module._forward_pre_hooks, module._forward_hooks) for hook in hooks.values()
             if not _quiet(hook)]
    found += [f"every module: {_name(hook)}" for hooks in (module_hooks._global_forward_pre_hooks,
                                                             module_hooks._global_forward_hooks)
              for hook in hooks.values() if not _quiet(hook)]
    if found:
        warnings.warn(
            f"piecewise: the model has Python forward hooks ({'; '.join(found[:4])}"
            f"{f'; and {len(found) - 4} more' if len(found) > 4 else ''}). A hook that changes its module's output is "
            f"captured as it ran. One that reads or keeps activations sees the padded rows of each call, and once "
            f"graphs replay it does not run (breakable) or keeps tensors in graph memory that the next call "
            f"overwrites (Dynamo). Return what such a hook needs from forward, or call the model itself for those "
            f"calls.", stacklevel=caller_stacklevel())
    return found


def _quiet(hook) -> bool:
    return str(getattr(hook, "__module__", "") or "").startswith(_QUIET)


def _name(hook) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def _tables(model: torch.nn.Module) -> list[tuple[str, dict]]:
    """(where, hook table) of every module's forward pre-hooks and hooks, and the global ones."""
    tables = [(f"{name or 'the model'} ({kind})", getattr(module, f"_{kind}s")) for name, module in model.named_modules()
              for kind in ("forward_pre_hook", "forward_hook")]
    return tables + [("every module (forward_pre_hook)", module_hooks._global_forward_pre_hooks),
                     ("every module (forward_hook)", module_hooks._global_forward_hooks)]


def _hooks(tables: list[tuple[str, dict]]) -> dict[tuple[str, int], str]:
    """(where, the hook function's id) → its name, transformers' output-collecting hooks left out (``_QUIET``): the
    same function registered again is the same hook."""
    return {(where, id(hook)): _name(hook) for where, table in tables for hook in table.values() if not _quiet(hook)}


class HookState:
    """The model's Python forward hooks at the first call; ``change()`` names those added or removed since, or None.

    Cheap where nothing changed: torch's handle counter (``RemovableHandle.next_id``) moves at every registration
    anywhere, and only the tables that held hooks at the first call (and the global ones) can lose one; the
    modules are walked again only when either moved (a tensor hook registered elsewhere walks them once)."""

    def __init__(self, model: torch.nn.Module):
        self.model = inner(model)
        self.first = _hooks(_tables(self.model))
        self.counter = RemovableHandle.next_id
        self.watched = [table for where, table in _tables(self.model) if table or where.startswith("every module")]
        self.size = sum(map(len, self.watched))

    def change(self) -> str | None:
        if RemovableHandle.next_id == self.counter and sum(map(len, self.watched)) == self.size:
            return None
        now = _hooks(_tables(self.model))
        if now == self.first:
            self.counter = RemovableHandle.next_id
            return None
        added = [f"{where}: {name}" for (where, key), name in now.items() if (where, key) not in self.first]
        removed = [f"{where}: {name}" for (where, key), name in self.first.items() if (where, key) not in now]
        listed = "; ".join([*(f"added {a}" for a in added[:3]), *(f"removed {r}" for r in removed[:3])])
        return f"the model's Python forward hooks changed since the first call ({listed})"


def top_level_hooks(model: torch.nn.Module) -> list[str]:
    """Hooks that run around the compiled module's own call (its pre-hooks and hooks, the global ones), named;
    none behind a ``TokensFirst``, whose forward calls the user's module (its hooks inside the trace)."""
    if inner(model) is not model:
        return []
    tables = [("the model", model._forward_pre_hooks), ("the model", model._forward_hooks),
              ("every module", module_hooks._global_forward_pre_hooks),
              ("every module", module_hooks._global_forward_hooks)]
    return [f"{where}: {_name(hook)}" for where, table in tables for hook in table.values() if not _quiet(hook)]


def refuse_positional_pre_hooks(model: torch.nn.Module) -> None:
    """Pre-hooks on the user's module that take its positional arguments (not ``with_kwargs``) are refused before
    the first call runs anything: piecewise calls the forward with keyword arguments, so they would see none (and
    change nothing, or fail). (Global pre-hooks, torch's module trackers among them, read no argument.)"""
    model = inner(model)
    hooks = [f"the model: {_name(hook)}" for key, hook in model._forward_pre_hooks.items()
             if not model._forward_pre_hooks_with_kwargs.get(key) and not _quiet(hook)]
    if hooks:
        raise ForwardRefused(
            f"piecewise: the compiled module has forward pre-hooks that take its positional arguments "
            f"({'; '.join(hooks[:3])}); piecewise calls the forward with keyword arguments, so they would see none. "
            f"Register them with register_forward_pre_hook(..., with_kwargs=True) reading the keywords, or on a "
            f"submodule.", "module_hook")
