"""``TokensFirst``: the model behind forward arguments whose token dimension is first.

The runtime pads, stages and cuts every token argument along dimension 0. A model that takes its tokens in
another dimension (gpt-fast's ``idx`` [batch, tokens], transformers' ``input_ids``) gets them back in its own
layout: each such argument arrives with its tokens first (``Arguments.take``: ``movedim(dim, 0)``, a view of the
caller's tensor or of a staged buffer) and goes to the model as ``movedim(0, dim)``, again a view, so the model
reads the staged memory itself. Outputs are cut along their own token dimension either way (``Core.finish``).
"""

from __future__ import annotations

from typing import Any

import torch


class TokensFirst(torch.nn.Module):
    """``forward(**arguments)``: ``model(**arguments)`` with each argument named in ``moved`` put back from
    tokens-first into its own layout. Mode, parameters and hooks are the model's."""

    def __init__(self, model: torch.nn.Module, moved: dict[str, int]):
        super().__init__()
        self.model = model
        self.moved = dict(moved)

    @property
    def training(self) -> bool:  # the model's mode: model.train() / .eval() on it are seen by the runtime
        model = self.__dict__.get("_modules", {}).get("model")
        return False if model is None else model.training

    @training.setter
    def training(self, mode: bool) -> None:
        model = self.__dict__.get("_modules", {}).get("model")
        if model is not None:
            model.train(mode)

    def forward(self, **arguments: Any) -> Any:
        for name, dim in self.moved.items():
            value = arguments.get(name)
            if isinstance(value, torch.Tensor):
                arguments[name] = value.movedim(0, dim)
        return self.model(**arguments)


def inner(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model behind a ``TokensFirst``."""
    return model.model if isinstance(model, TokensFirst) else model
