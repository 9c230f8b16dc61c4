"""The random generators the first call's rehearsals draw from, put back after them: Python's, torch's default
ones, and the caller's own ``torch.Generator`` objects (in the arguments or the modules' attributes)."""

from __future__ import annotations

import random
from typing import Any

import torch

from ..errors import ForwardRefused

OWN_GENERATORS: list[torch.Generator] = []
"""The caller's own ``torch.Generator`` objects the first call running now found (``own_generators``): its
rehearsals would move them on (vLLM's per-request seeded sampling), so ``RandomState`` holds them too."""


class RandomState:
    """Python's and torch's generator states (CPU, every initialised CUDA device, and ``OWN_GENERATORS``), to draw
    the same numbers again."""

    def __init__(self):
        self.python = random.getstate()
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.own = [(generator, generator.get_state()) for generator in OWN_GENERATORS]

    def same(self, other: RandomState) -> bool:
        cuda = (self.cuda is None) == (other.cuda is None) and all(
            torch.equal(a, b) for a, b in zip(self.cuda or (), other.cuda or ()))
        own = all(torch.equal(a, b) for (_, a), (_, b) in zip(self.own, other.own))
        return self.python == other.python and torch.equal(self.cpu, other.cpu) and cuda and own

    def restore(self) -> None:
        random.setstate(self.python)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        for generator, state in self.own:
            generator.set_state(state)


def refuse_cuda_generators(model: torch.nn.Module, arguments: dict[str, Any]) -> None:
    """A CUDA ``torch.Generator`` of the caller's (``OWN_GENERATORS``): the graphs would not move it on (Dynamo's
    replays drew other numbers than eager at every call on an H200; breakable's capture fails on it)."""
    own = [g for g in OWN_GENERATORS if g.device.type == "cuda"]
    if not own:
        return
    names = [f"argument {name!r}" for name, value in arguments.items() if any(value is g for g in own)] + [
        f"attribute `{prefix + '.' if prefix else ''}{key}`" for prefix, module in model.named_modules()
        for key, value in vars(module).items() if any(value is g for g in own)]
    where = ", ".join(names) or "found in its arguments"
    raise ForwardRefused(
        f"piecewise: the forward draws from a torch.Generator of its own on CUDA ({where}). Piecewise's CUDA "
        f"graphs replay random draws from torch's default generator only: from another one a replay would not draw "
        f"what eager draws. Sample outside forward (as vLLM and SGLang do, "
        f"after it), draw from the default generator (torch.manual_seed), or compile with "
        f"CaptureConfig(cuda_graphs=False).", "capture_illegal")


def own_generators(model: torch.nn.Module, arguments: dict[str, Any]) -> list[torch.Generator]:
    """The ``torch.Generator`` objects among the arguments (in a list, a dict or an object's attributes too) and
    the modules' attributes, each once."""
    found: list[torch.Generator] = []
    values = []
    for value in arguments.values():
        values.append(value)
        if isinstance(value, (list, tuple)):
            values += value
        elif isinstance(value, dict):
            values += value.values()
        elif hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, type)):
            values += vars(value).values()
    values += [value for module in model.modules() for value in vars(module).values()]
    for value in values:
        if isinstance(value, torch.Generator) and all(value is not g for g in found):
            found.append(value)
    return found
