"""``PiecewiseModel``: the call path. Bind the arguments, pick the capture size, stage, run the front-end, un-pad.

The first call (``first_call.prepare``) warms up, chooses the front-end, checks padding and captures. Later
calls pad to the smallest captured size ≥ the token count and replay; calls above the top of the graphs (or
padded past ``max_padding_factor``) run the same forward without padding or graphs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from ..capture.buffers import direct_tokens
from ..capture.segment import runner_call
from ..capture.state import Call, Phase
from ..config import CaptureConfig
from ..errors import REFUSALS, BlockerKind, ForwardRefused, StateChanged, first_line
from ..opaque import resolve_splitting_ops
from . import first_call, op_reads, search
from .core import Core
from .layout import inner
from .verify import VerifyReport, verify

logger = logging.getLogger(__name__)


class PiecewiseModel(Core):
    """A model whose forward runs as captured pieces with eager splitting ops between them.

    Call it like the model. The first call warms up eagerly, prepares the front-end (a Dynamo trace, or none
    for the breakable front-end), and on CUDA captures every capture size; later calls pad to the smallest
    captured size ≥ the token count and replay. A call that differs from the first in what the graphs depend on
    (``CallGuard``) runs the model's own forward, with one warning.
    """

    def __init__(self, model: torch.nn.Module, config: CaptureConfig, dynamic: dict[str, int] | None):
        super().__init__(model, config, dynamic)
        if config.splitting_ops is not None:
            resolve_splitting_ops(config.splitting_ops)  # an unknown name is an error now, not at the first call
        self._prepared = False
        self._running = False

    @property
    def token_arguments(self) -> dict[str, int] | None:
        """Forward arguments that carry the token dimension (known after the first call without dynamic=)."""
        dynamic = self.arguments.dynamic
        return None if dynamic is None else {name: self.arguments.moved.get(name, 0) for name in dynamic}

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("piecewise: a runner holds CUDA graphs, compiled code and buffers of this process, and cannot "
                        "be copied or pickled: copy or pickle the model, and piecewise.compile the copy")

    def __call__(self, *args, **kwargs) -> Any:
        if torch.compiler.is_compiling():  # inside the caller's torch.compile: run outside its trace (a graph break)
            return _outside_compile(self, args, kwargs)
        with runner_call():  # one runner call (and capture) at a time in the process
            return self._call_once(args, kwargs)

    def _call_once(self, args: tuple, kwargs: dict) -> Any:
        if self._running:
            patched = "model.forward = runner: " if self.model.__dict__.get("forward") is not None else ""
            raise RuntimeError(
                f"piecewise: the runner was called from inside its own call ({patched}the model's forward calls the "
                f"runner, which runs the model's forward). Leave the model's forward as it is and call the runner "
                f"instead of the model; inside an outer model (vLLM's LlamaForCausalLM around LlamaModel), keep the "
                f"runner beside the inner module (`self.runner = piecewise.compile(self.model)`) and call "
                f"`self.runner(...)` in the outer forward.")
        self._running = True
        try:
            return self._call(args, kwargs)
        finally:
            self._running = False

    def _call(self, args: tuple, kwargs: dict) -> Any:
        self.watch.check()
        arguments = self.take(args, kwargs)
        tokens = self.arguments.token_count(arguments)
        if self._prepared:
            for tensor in self.arguments.adopt_late(arguments, tokens):
                self.state.stable_ptrs.add(tensor.data_ptr())
                self.state.static_storages.add(tensor.untyped_storage().data_ptr())
        self.arguments.check_static(arguments)
        self.last_arguments, self.given = arguments, (args, kwargs)
        # Inference semantics for everything piecewise runs, whatever the caller's grad mode: no autograd graph,
        # and piecewise's buffers are inference tensors that every later call may write. The outputs are copied
        # outside, so that the caller gets ordinary tensors; a call the graphs cannot serve runs the model's own
        # forward there too, its outputs copied outside.
        with self.watch:
            with torch.inference_mode():
                difference = self.guard.difference(arguments) if self._prepared else None
                if difference is not None:
                    self.guard.warn_once(difference)
                    self.stats.eager_calls += 1
                    output = self._own_forward()
            if difference is not None:
                return self.finish(output, tokens, tokens, clone=True)
            return self._serve(arguments, tokens)

    def _serve(self, arguments: dict[str, Any], tokens: int) -> Any:
        with torch.inference_mode():
            if not self._prepared:
                self._prepare(arguments)
            full = self.full.bucket(tokens) if self.full.sizes else None
            size = full if full is not None else self.ladder.bucket(tokens)
            try:
                if self.state.outside_reads and self.state.graphs_enabled and \
                        (why := op_reads.stale(self.state.outside_reads)) is not None:
                    raise StateChanged(why)
                if full is not None:
                    self.stats.full_calls += 1
                    output = self.full.run(arguments, tokens, full)
                elif size is None or self.full.mode == "full":
                    output = self._run_direct(arguments, tokens)
                    size = tokens
                else:
                    staged = self.stager.stage(arguments, self.arguments.given_tokens(arguments), tokens, size)
                    self.frontend.check_state(staged, full=False)
                    phase = Phase.REPLAY if self.state.capture_done else Phase.PADDED
                    self.stats.padded_calls += 1
                    output = self.run_call(Call(phase, size, tokens), staged)
            except StateChanged as change:  # before anything ran: the model's own forward serves this call
                self.guard.warn_once(str(change))
                self.stats.eager_calls += 1
                output, size = self._own_forward(), tokens
                return self.finish(output, tokens, size, clone=True)
        return self.finish(output, tokens, size)

    def _own_forward(self) -> Any:
        """The model called as the caller called the runner (its hooks see the same positional arguments)."""
        args, kwargs = self.given
        return inner(self.model)(*args, **kwargs)

    def _prepare(self, arguments: dict[str, Any]) -> None:
        try:
            _refuse_transformers_caches(arguments)  # before anything runs: nothing of the caller's to put back
            self._prepare_with_hints(arguments)
        except BaseException:
            self.arguments.forget_first()  # the next call is a first call again: its arguments decide afresh
            raise

    def _prepare_with_hints(self, arguments: dict[str, Any]) -> None:
        try:
            self._prepare_first(arguments)
        except ForwardRefused as exc:
            hinted = _with_hints(exc, arguments, self.arguments)
            if hinted is exc:
                raise
            raise hinted.with_traceback(exc.__traceback__) from exc.__cause__
        except (ValueError, TypeError, IndexError, RuntimeError) as exc:  # the model's own error on rows piecewise made
            note = self.arguments.taken_note()
            if not note or min(self.arguments.first_shapes.get(n, (0,))[0] for n in self.arguments.dynamic) != 1 \
                    or isinstance(exc, REFUSALS):
                raise
            raise ForwardRefused(f"piecewise: the first call failed: {first_line(exc)}.{note}", "token_layout",
                                 []) from exc

    def _prepare_first(self, arguments: dict[str, Any]) -> None:
        auto = self.config.compiler == "auto"
        if auto and search.measures(self):  # each compiler's runner prepared and timed: the fastest's state is ours
            search.choose(self, (), arguments)
            return
        given = self.config
        if auto:  # nothing to measure (no CUDA graphs): prepared exactly as with compiler="eager"
            self.config = dataclasses.replace(given, compiler="eager")
        started = time.perf_counter()
        self._prepared = True
        try:
            first_call.prepare(self, arguments)
        except Exception:
            self._prepared, self.config = False, given  # the next call checks again (and fails the same way)
            raise
        if auto:
            search.unmeasured(self, time.perf_counter() - started)

    def _run_direct(self, arguments: dict[str, Any], tokens: int) -> Any:
        """Without padding or graphs; token arguments handed over as padded calls' are (``direct_tokens``)."""
        direct = direct_tokens(arguments, self.arguments.given_tokens(arguments))
        self.stats.fallback_calls += 1
        return self.run_call(Call(Phase.DIRECT, tokens, tokens), direct)

    def capture(self, *args, **kwargs) -> None:
        """Warm up, prepare and capture every size now (with these example inputs, or the last call's)."""
        if args or kwargs:
            arguments = self.take(args, kwargs)
            self.arguments.token_count(arguments)
        elif self.last_arguments is not None:
            arguments = self.last_arguments
        else:
            raise ValueError("PiecewiseModel.capture() needs example inputs: call it with the model's arguments")
        if self._prepared:
            return
        self.last_arguments = arguments
        with runner_call(), self.watch, torch.inference_mode():
            self._prepare(arguments)

    def verify(self, *args, sizes: list[int] | None = None, make_inputs=None, **kwargs) -> VerifyReport:
        """Check every captured size (or ``sizes``) against the eager model: per size the size itself, one token
        below it and the smallest count that pads to it, with inputs other than the capture's (made from these
        example arguments, or the last call's; ``make_inputs(num_tokens)`` returns ``args`` or ``(args,
        kwargs)`` instead, whose static tensors are replaced by the captured ones). Outputs and written static
        tensors (KV caches) are compared within a dtype-aware tolerance; a mismatch names the stretch of the forward where the runner first parts from eager. Static
        tensors are restored afterwards. Captures first if this runner has not run yet."""
        if args or kwargs:
            example = self.take(args, kwargs)
            if not self._prepared:
                self.capture(*args, **kwargs)
        elif self.last_arguments is not None:
            example = self.last_arguments
        else:
            raise ValueError("PiecewiseModel.verify() needs example inputs: call it with the model's arguments")
        with runner_call(), self.watch:
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
        self.stats.update(cuda_graphs=False, graphs=0, captured_sizes=[], full_only_sizes=[], pool_bytes=0)

    def __enter__(self) -> "PiecewiseModel":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release_graphs()


def compile(
    model: torch.nn.Module, config: CaptureConfig | None = None, *, dynamic: dict[str, int] | None = None
) -> PiecewiseModel:
    """Make ``model`` run as piecewise CUDA graphs.

    ``dynamic`` maps forward argument names to their token dimension (``{"idx": 1, "input_pos": 0}`` for
    gpt-fast's ``[batch, tokens]`` ids); default: dimension 0 of the first forward argument, or dimension 1 where
    it holds token ids shaped ``[1, n > 1]`` (one batch-first sequence), and the other tensor arguments of as many
    tokens. Every other tensor argument is static: it must be the same storage on every call (KV caches), or the
    call raises ``ValueError`` naming it.
    """
    return PiecewiseModel(model, config if config is not None else CaptureConfig(), dynamic)


_ABOUT_ROWS = {BlockerKind.TOKEN_MIXING, BlockerKind.TOKEN_BRANCH, BlockerKind.TOKEN_LAYOUT}
"""Refusals about which rows are tokens: where ids were taken batch-first, the other reading is worth naming."""


def _is_transformers_cache(value: Any) -> bool:
    return any(cls.__module__.startswith("transformers.cache") for cls in type(value).__mro__[:-1])


def _refuse_transformers_caches(arguments: dict[str, Any]) -> None:
    """transformers' own cache object among the arguments: refused before any run. Its forward updates the object on
    every run (a DynamicCache grows, a StaticCache counts its length), which the first call's several runs would
    repeat; a DynamicCache also changed the trace's shapes at each run, each a new Dynamo trace and warning, before a
    check refused it for a reason that named neither (42 s on a 2-layer model on a CPU)."""
    names = [name for name, value in arguments.items() if _is_transformers_cache(value)]
    if names:
        given = ", ".join(f"{n}={type(arguments[n]).__name__}" for n in names)
        raise ForwardRefused(
            f"piecewise: {given} is transformers' own KV cache object, which the forward updates on every run "
            f"(appending to it, or writing it and counting its length). The first call runs the forward several "
            f"times (warm-up, checks, one run per capture size), and a captured graph would keep the cache's length "
            f"at its capture. Decode through piecewise's cache: piecewise.generate(model, prompts), or "
            f"integrations.token_model.TokenModel(integrations.transformers.enable(model)) with a cache from its "
            f"make_kv_cache (one graph set for prefill and decode of many sequences).",
            BlockerKind.TRANSFORMERS_CACHE.value, [])


def _with_hints(exc: ForwardRefused, arguments: dict[str, Any], binder: Any) -> ForwardRefused:
    """A first call's refusal, with what the caller may not know: the token dimension piecewise found by itself
    where it took ids batch-first."""
    notes = []
    if binder.moved and not binder.dynamic_given and exc.kind in _ABOUT_ROWS:
        taken = ", ".join(f"{name!r} {binder.user_shape(name, tuple(arguments[name].shape))}" for name in binder.moved
                          if isinstance(arguments.get(name), torch.Tensor))
        notes.append(f"piecewise took {taken} as one sequence, the tokens in dimension 1 (ids shaped [1, n]); if "
                     f"dimension 0 carries the tokens, pass dynamic={{{', '.join(f'{n!r}: 0' for n in binder.dynamic)}}}.")
    if not notes:
        return exc
    return ForwardRefused(" ".join([str(exc), *notes]), exc.kind, exc.chain)


@torch._dynamo.disable
def _outside_compile(runner: PiecewiseModel, args: tuple, kwargs: dict) -> Any:
    """A runner called from code the caller compiles runs as it does outside: its own trace and graphs cannot be
    part of another trace. (Not through ``runner(...)``: torch's compiling flag is the process's, set for the whole
    of another thread's compile or an export, and would send the call here again.)"""
    with runner_call():
        return runner._call_once(args, kwargs)

