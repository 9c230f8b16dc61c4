"""``PiecewiseModel``: the call path. Bind the arguments, pick the capture size, stage, run the front-end, un-pad.

The first call (``first_call.prepare``) warms up, chooses the front-end, checks padding and captures. Later
calls pad to the smallest captured size ≥ the token count and replay; calls above the top of the graphs (or
padded past ``max_padding_factor``) run the same forward without padding or graphs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .. import _compat
from ..capture.buffers import InputStager
from ..capture.ladder import Ladder
from ..capture.state import IDLE, Call, CaptureState, Phase
from ..capture.stats import Stats
from ..config import CaptureConfig
from ..context import forward_context
from ..opaque import resolve_splitting_ops
from . import first_call
from .arguments import Arguments
from .full_graphs import FullGraphs
from .verify import VerifyReport, verify
from .watch import ParameterWatch

logger = logging.getLogger(__name__)


class PiecewiseModel:
    """A model whose forward runs as captured pieces with eager splitting ops between them.

    Call it like the model. The first call warms up eagerly, prepares the front-end (a Dynamo trace, or none
    for the breakable front-end), and on CUDA captures every capture size; later calls pad to the smallest
    captured size ≥ the token count and replay.
    """

    def __init__(self, model: torch.nn.Module, config: CaptureConfig, dynamic: dict[str, int] | None):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"piecewise.compile expects a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(config, CaptureConfig):
            raise TypeError(
                f"piecewise.compile: config must be a piecewise.CaptureConfig, got {type(config).__name__}; "
                f"write piecewise.CaptureConfig(**{config!r})" if isinstance(config, dict) else
                f"piecewise.compile: config must be a piecewise.CaptureConfig, got {type(config).__name__}"
            )
        self.model = model
        self.config = config
        if config.splitting_ops is not None:
            resolve_splitting_ops(config.splitting_ops)  # an unknown name is an error now, not at the first call
        self.arguments = Arguments(model, dynamic)
        self.state = CaptureState(max_tokens=config.max_tokens)
        self.ladder = Ladder(config.sizes, config.max_padding_factor)
        self.stats = Stats(capture_sizes=self.ladder.sizes, size_notes=self.ladder.notes)
        self.stager = InputStager(config.max_tokens, self.state.stable_ptrs)
        self.watch = ParameterWatch(model)
        self.full = FullGraphs(self)
        self.frontend: Any = None
        """The front-end in use (``DynamoFrontend`` or ``BreakableFrontend``), chosen at the first call."""
        self.last_arguments: dict[str, Any] | None = None
        self._prepared = False

    @property
    def token_arguments(self) -> dict[str, int] | None:
        """Forward arguments that carry the token dimension (known after the first call without dynamic=)."""
        return None if self.arguments.dynamic is None else dict(self.arguments.dynamic)

    def __call__(self, *args, **kwargs) -> Any:
        self.watch.check()
        arguments = self.arguments.bind(args, kwargs)
        tokens = self.arguments.token_count(arguments)
        if self._prepared:
            for tensor in self.arguments.adopt_late(arguments, tokens):
                self.state.stable_ptrs.add(tensor.data_ptr())
                self.state.static_storages.add(tensor.untyped_storage().data_ptr())
        self.arguments.check_static(arguments)
        self.last_arguments = arguments
        # Inference semantics for everything piecewise runs, whatever the caller's grad mode: no autograd graph,
        # and piecewise's buffers are inference tensors that every later call may write. The outputs are copied
        # outside, so that the caller gets ordinary tensors.
        with self.watch, torch.inference_mode():
            if not self._prepared:
                self._prepare(arguments)
            full = self.full.bucket(tokens) if self.full.sizes else None
            size = full if full is not None else self.ladder.bucket(tokens)
            if full is not None:
                self.stats.full_calls += 1
                output = self.full.run(arguments, tokens, full)
            elif size is None or self.full.mode == "full":
                output = self._run_direct(arguments, tokens)
                size = tokens
            else:
                staged = self.stager.stage(arguments, self.arguments.given_tokens(arguments), tokens, size)
                phase = Phase.REPLAY if self.state.capture_done else Phase.PADDED
                self.stats.padded_calls += 1
                output = self.run_call(Call(phase, size, tokens), staged)
        return self.finish(output, tokens, size)

    def _prepare(self, arguments: dict[str, Any]) -> None:
        self._prepared = True
        try:
            first_call.prepare(self, arguments)
        except Exception:
            self._prepared = False  # the next call checks again (and fails the same way)
            raise

    def _run_direct(self, arguments: dict[str, Any], tokens: int) -> Any:
        """Without padding or graphs. Token arguments go in as aliases made here, in inference mode, like the
        staged buffers of padded calls: to Dynamo's guards both kinds of call look the same, whether the caller's
        tensors were made inside ``torch.inference_mode()`` or outside."""
        direct = dict(arguments)
        for name in self.arguments.given_tokens(arguments):
            value = arguments[name]
            if not value.is_inference():
                value = _compat.storage_alias(value, value.shape[0])
            _compat.mark_token_dim(value, 0)
            direct[name] = value
        self.stats.fallback_calls += 1
        return self.run_call(Call(Phase.DIRECT, tokens, tokens), direct)

    def run_call(self, call: Call, arguments: dict[str, Any], rehearsal: bool = False) -> Any:
        """Run the front-end's forward for ``call``: the one place the call descriptor is set."""
        state = self.state
        state.call = call
        state.splitting_op_calls = 0
        state.token_outputs.clear()
        try:
            with forward_context(call.num_tokens, call.size, capturing=call.phase is Phase.CAPTURE, rehearsal=rehearsal,
                                 token_mask=self.full.masks.get(call.size) if call.full else None):
                output = self.frontend.run(arguments)
        finally:
            state.call = IDLE
        self.stats.splitting_op_calls = state.splitting_op_calls
        return output

    def finish(self, output: Any, tokens: int, size: int, clone: bool | None = None) -> Any:
        """Cut padded outputs back to the real rows; copy them unless ``clone_outputs=False``."""
        token_ids = self.state.token_outputs
        clone = self.config.clone_outputs if clone is None else clone

        def fix(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            token = token_ids.get(id(value))
            if token is None:  # not from a symbolic graph (breakable, Python after a break): the padded length
                token = value.dim() > 0 and value.shape[0] == size
            if token and tokens != size:
                value = value[:tokens]
            return value.clone() if clone else value

        if isinstance(output, torch.Tensor):  # the usual case, without the pytree walk
            return fix(output)
        return torch.utils._pytree.tree_map(fix, output)

    def capture(self, *args, **kwargs) -> None:
        """Warm up, prepare and capture every size now (with these example inputs, or the last call's)."""
        if args or kwargs:
            arguments = self.arguments.bind(args, kwargs)
            self.arguments.token_count(arguments)
        elif self.last_arguments is not None:
            arguments = self.last_arguments
        else:
            raise ValueError("PiecewiseModel.capture() needs example inputs: call it with the model's arguments")
        if self._prepared:
            return
        self.last_arguments = arguments
        with self.watch, torch.inference_mode():
            self._prepare(arguments)

    def verify(self, *args, sizes: list[int] | None = None, make_inputs=None, **kwargs) -> VerifyReport:
        """Check every captured size (or ``sizes``) against the eager model: per size the size itself, one token
        below it and the smallest count that pads to it, with inputs other than the capture's (made from these
        example arguments, or the last call's; ``make_inputs(num_tokens)`` returns ``args`` or ``(args,
        kwargs)`` instead, whose static tensors are replaced by the captured ones). Outputs and written static
        tensors (KV caches) are compared within a dtype-aware tolerance; a mismatch names the stretch of the forward where the runner first parts from eager. Static
        tensors are restored afterwards. Captures first if this runner has not run yet."""
        if args or kwargs:
            example = self.arguments.bind(args, kwargs)
            if not self._prepared:
                self.capture(*args, **kwargs)
        elif self.last_arguments is not None:
            example = self.last_arguments
        else:
            raise ValueError("PiecewiseModel.verify() needs example inputs: call it with the model's arguments")
        with self.watch:
            return verify(self, example, sizes, make_inputs)

    def release_graphs(self) -> None:
        """Destroy every captured CUDA graph and the memory pool they share; later calls run the same pieces
        padded, without graphs (same outputs, ``stats["cuda_graphs"]`` False).

        Call it before ``torch.distributed.destroy_process_group()`` when collectives were captured in the
        graphs (``capture_all_reduce=True``): NCCL holds each communicator open until every graph that
        captured one of its collectives is destroyed, so destroying the group first never returns."""
        state = self.state
        if state.pool is not None:
            torch.cuda.synchronize()
        if self.frontend is not None:
            self.frontend.release()
        self.full.release()
        state.pool = state.workspace_graph = None
        state.retired_pools.clear()
        state.graphs_enabled = False
        self.stats.update(cuda_graphs=False, graphs=0, captured_sizes=[], pool_bytes=0)

    def __enter__(self) -> "PiecewiseModel":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release_graphs()


def compile(
    model: torch.nn.Module, config: CaptureConfig | None = None, *, dynamic: dict[str, int] | None = None
) -> PiecewiseModel:
    """Make ``model`` run as piecewise CUDA graphs.

    ``dynamic`` maps forward argument names to their token dimension (only dimension 0 is supported);
    default: dimension 0 of the first forward argument. Every other tensor argument is static: it must be
    the same storage on every call (KV caches), or the call raises ``ValueError`` naming it.
    """
    return PiecewiseModel(model, config if config is not None else CaptureConfig(), dynamic)
