"""What one compiled model's call path, first call, full graphs and ``verify`` share: its parts, the front-end in
use, and the two primitives every run goes through: ``run_call`` (the one place the call descriptor is set) and
``finish`` (padded outputs cut back to the real rows)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..capture.buffers import InputStager
from ..capture.ladder import Ladder
from ..capture.outputs import map_outputs, padded_dim
from ..capture.state import IDLE, Call, CaptureState, Phase
from ..capture.stats import Stats
from ..config import CaptureConfig
from ..context import forward_context
from ..frontends import Frontend, Parts
from .arguments import Arguments
from .full_graphs import FullGraphs
from .guards import CallGuard
from .layout import TokensFirst
from .watch import ParameterWatch

_UNKNOWN = object()


class Core:
    """The parts of one compiled model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, config: CaptureConfig, dynamic: dict[str, int] | None):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"piecewise.compile expects a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(config, CaptureConfig):
            raise TypeError(
                f"piecewise.compile: config must be a piecewise.CaptureConfig, got {type(config).__name__}; "
                f"write piecewise.CaptureConfig(**{config!r})" if isinstance(config, dict) else
                f"piecewise.compile: config must be a piecewise.CaptureConfig, got {type(config).__name__}"
            )
        original = getattr(model, "_orig_mod", None)
        if isinstance(original, torch.nn.Module) and type(model).__name__ == "OptimizedModule":
            warnings.warn("piecewise.compile got a torch.compile'd module: piecewise traces, compiles and captures the "
                          "original module (model._orig_mod) itself, without torch.compile's options; pass it directly",
                          stacklevel=4)
            model = original
        self.model = model
        self.config = config
        self.arguments = Arguments(model, dynamic)
        self.state = CaptureState(max_tokens=config.max_tokens)
        self.ladder = Ladder(config.sizes, config.max_padding_factor)
        self.stats = Stats(capture_sizes=self.ladder.sizes, size_notes=self.ladder.notes)
        self.stager = InputStager(config.max_tokens, self.state.stable_ptrs)
        self.watch = ParameterWatch(model)
        self.guard = CallGuard(model, self.arguments.user_shape)
        self.full = FullGraphs(self)
        self.frontend: Frontend | None = None
        """The front-end in use, chosen at the first call."""
        self.last_arguments: dict[str, Any] | None = None
        self.timing = False
        self._wrapped = False
        """Whether ``model`` is a ``TokensFirst`` this runner made (a search's trial is given its parent's)."""
        """Set while ``compiler="auto"`` times this runner: its calls are rehearsals (``runtime/search.py``)."""

    def take(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """A user call's arguments, token dimensions first (``Arguments.take``); where the model takes a token
        argument in another layout, the runtime calls it through ``TokensFirst`` from then on."""
        arguments = self.arguments.take(args, kwargs)
        if self.arguments.first_signature is None and self._wrapped:
            self.model, self._wrapped = self.model.model, False  # a first call again after a failed one: layout anew
        if self.arguments.moved and not isinstance(self.model, TokensFirst):
            self.model, self._wrapped = TokensFirst(self.model, self.arguments.moved), True
        return arguments

    def parts(self) -> Parts:
        """What a front-end is given of this runtime."""
        return Parts(self.model, self.config, self.state, self.ladder, self.stats, self.stager,
                     describe_change=lambda: self.arguments.describe_change(self.last_arguments),
                     token_names=lambda: list(self.arguments.dynamic))

    def run_call(self, call: Call, arguments: dict[str, Any], rehearsal: bool = False, token_mask: Any = None) -> Any:
        """Run the front-end's forward for ``call``: the one place the call descriptor is set."""
        state = self.state
        state.call = call
        state.splitting_op_calls = 0
        state.token_outputs.clear()
        try:
            with forward_context(call.num_tokens, call.size, capturing=call.phase is Phase.CAPTURE,
                                 rehearsal=rehearsal or self.timing, token_mask=token_mask):
                output = self.frontend.run(arguments)
        finally:
            state.call = IDLE
        self.stats.splitting_op_calls = state.splitting_op_calls
        return output

    def finish(self, output: Any, tokens: int, size: int, clone: bool | None = None) -> Any:
        """Cut padded outputs back to the real rows, along the token dimension the front-end gave for each (its
        first dimension as long as the padded size where it gave none); copy them unless ``clone_outputs=False``."""
        dims = self.state.token_outputs
        clone = self.config.clone_outputs if clone is None else clone

        def fix(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            dim = dims.get(id(value), _UNKNOWN)
            if dim is _UNKNOWN:  # no front-end knowledge (Python after a graph break): the padded length, unless
                # it is the model's own tensor or a static argument (a parameter returned as it is)
                dim = padded_dim(value, size) if value.untyped_storage().data_ptr() not in \
                    self.state.static_storages else None
            if dim is not None and tokens != size:
                value = value.narrow(dim, 0, tokens)
            return value.clone() if clone else value

        if isinstance(output, torch.Tensor):  # the usual case, without the pytree walk
            return fix(output)
        return map_outputs(fix, output)
