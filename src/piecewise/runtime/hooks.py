"""Python forward hooks on the model's modules, named at the first call.

A hook runs where the module runs: on the padded rows of a call (an activation it keeps has the capture size's
rows, not the call's), and, once graphs replay, not at all with the breakable front-end (it runs no Python) or, with
Dynamo, replayed from its trace (a tensor it keeps lives in graph memory that the next call overwrites). A hook
that only changes its module's output is captured as it ran, and is right. Which kind a hook is cannot be told from
outside: the first call warns once, naming them.
"""

from __future__ import annotations

import warnings

import torch
from torch.nn.modules import module as module_hooks

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
