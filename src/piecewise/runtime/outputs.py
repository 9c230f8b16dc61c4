"""Outputs piecewise cannot hand back right: tensors the forward made, inside an object that is not a container.

``Core.finish`` cuts each output tensor to the call's tokens and copies it out of the graphs' memory, walking
tuples, lists, dicts, pytree-registered classes (transformers' ``ModelOutput``) and dataclasses
(``capture.outputs.map_outputs``). A tensor inside any other object (transformers' ``DynamicCache`` in
``past_key_values``) would come back with the padded rows and in memory the next replay overwrites: refused at the
first call, naming it and what to do. Such an object that holds only the model's own tensors or the static
arguments (a cache passed in and returned) is served.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..capture.outputs import unmapped_leaves, walk_tensors
from ..errors import ForwardRefused

def refuse_made_tensors_in_objects(output: Any, kept: list[torch.Tensor], arguments: dict[str, Any]) -> None:
    """Refuse a (first, eager) output whose objects hold tensors other than the model's and the arguments' (``kept``
    and the tensors inside the arguments), where ``Core.finish`` would not cut and copy them: in objects other than
    containers and dataclasses, and in a dataclass's attributes that are not its fields."""
    known = {t.untyped_storage().data_ptr() for t in [*kept, *_argument_tensors(arguments)] if t.device.type != "meta"}
    for name, leaf in unmapped_leaves(output):
        for path, tensor in walk_tensors(leaf, name):
            if tensor is not None and (tensor.device.type == "meta" or tensor.untyped_storage().data_ptr() in known):
                continue
            what = f"tensors the forward made ({path}, shape {tuple(tensor.shape)})" if tensor is not None else \
                f"more objects than piecewise walks (past {path})"
            raise ForwardRefused(
                f"piecewise: the output holds {what}. piecewise cuts each output tensor to the "
                f"call's tokens and copies it out of the graphs' memory inside tuples, lists, dicts, dataclass fields "
                f"and ModelOutputs, not inside other objects: this one would come back with the padded rows, in "
                f"memory the next call overwrites. Return the tensors themselves, or leave the object out of the "
                f"output (transformers: call with use_cache=False; for a KV cache use piecewise.generate or "
                f"integrations.token_model.TokenModel).",
                "output_object")


def _argument_tensors(arguments: dict[str, Any]) -> list[torch.Tensor]:
    return [tensor for value in arguments.values() if not isinstance(value, torch.Tensor)
            for _, tensor in walk_tensors(value) if tensor is not None]


def warn_of_kept_tensors(model: torch.nn.Module, places: list[tuple[str, str]], size: int) -> None:
    """The forward assigns a new tensor to a module attribute on every run (``self.last_hidden = x``, read by an
    EAGLE-style drafter after the call): Dynamo's code replays the assignment, with the tensor of the padded call."""
    modules = dict(model.named_modules())
    kept = [f"{name}.{key}" if name else f"self.{key}" for name, key in places
            if name in modules and isinstance(vars(modules[name]).get(key), torch.Tensor)]
    if kept:
        warnings.warn(
            f"piecewise: the forward keeps a tensor it makes in {', '.join(f'`{k}`' for k in kept[:3])} on every "
            f"call. Calls are padded to a capture size (here {size} tokens for the first), so it holds the padded "
            f"call's tensor: the call's rows first, then padding rows, in memory the next call may overwrite. Return "
            f"it from forward instead (outputs are cut to the call's rows and copied out), or read only its first T "
            f"rows before the next call.", stacklevel=7)
