"""``piecewise.compile``: the model-level runner that pads, captures and replays."""

from __future__ import annotations

import bisect
import contextlib
import gc
import inspect
import logging
import re
import time
import traceback
import warnings
import weakref
from typing import Any

import torch

from . import _compat
from .compilers import make_compiler
from .config import CaptureConfig
from .context import forward_context
from .cudagraph import CAPTURE, DIRECT, PADDED, REPLAY, CaptureState, GraphRunner, RowBuffer, is_token_tensor
from .opaque import op_name, splitting_op_names
from .split import accumulates, describe_write, token_mixing_nodes, user_line, writes_to_inputs
from .trace import ForwardTracer

logger = logging.getLogger(__name__)


class ForwardRefused(ValueError):
    """A forward piecewise cannot run correctly with padding and repeated first-call runs. ``kind`` is the
    doctor's blocker kind (``token_mixing``, ``token_branch``, ``state_update``, ``token_argument_write``);
    ``chain`` the model frames involved, forward first."""

    def __init__(self, message: str, kind: str, chain: list[traceback.FrameSummary] | None = None):
        super().__init__(message)
        self.kind = kind
        self.chain = list(chain or [])


class _RandomState:
    """Python's and torch's generator states (CPU and every initialised CUDA device), to draw the same numbers
    again."""

    def __init__(self):
        import random

        self.python = random.getstate()
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def restore(self) -> None:
        import random

        random.setstate(self.python)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


_calls_in_progress: list = []  # runners inside __call__ (a forward may assign its own attributes)
_watched: "weakref.WeakSet[PiecewiseModel]" = weakref.WeakSet()
_hooks: list = []  # torch's handles of the registration hooks below


def _on_registration(kind: str):
    def hook(module: torch.nn.Module, name: str, value: Any) -> None:
        # Dynamo traces a forward's own attribute assignments into this hook: nothing for it to see here.
        if torch.compiler.is_compiling() or _calls_in_progress or not _watched:
            return None
        for runner in list(_watched):
            if runner._replaced is None and module in runner._modules:
                prefix = next((n for n, m in runner.model.named_modules() if m is module), "")
                runner._replaced = f"{kind} `{prefix + '.' if prefix else ''}{name}` was replaced by a new object"
        return None

    return hook


def _watch(runner: "PiecewiseModel") -> None:
    """Flag ``runner`` when one of its model's parameters, buffers or submodules is assigned a new object
    outside a call (torch's global registration hooks, installed with the first runner)."""
    if not _hooks:
        modules = torch.nn.modules.module
        _hooks.append(modules.register_module_parameter_registration_hook(_on_registration("parameter")))
        _hooks.append(modules.register_module_buffer_registration_hook(_on_registration("buffer")))
        _hooks.append(modules.register_module_module_registration_hook(_on_registration("submodule")))
    runner._modules = weakref.WeakSet(runner.model.modules())  # by identity; a module dropped later drops out
    _watched.add(runner)


def _node_chain(node: torch.fx.Node) -> list[traceback.FrameSummary]:
    from .diagnostics._dynamo import node_stack

    return node_stack(node)


def _progress():
    """A rich progress bar on a terminal, nothing otherwise."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    if not console.is_terminal:
        return contextlib.nullcontext(None)
    progress = Progress(console=console, transient=True)
    return progress


class PiecewiseModel:
    """A model whose forward runs as captured pieces with eager splitting ops between them.

    Call it like the model. The first call warms up eagerly, traces once, and (on CUDA) captures every
    capture size; later calls pad to the smallest captured size ≥ the token count and replay.
    """

    def __init__(self, model: torch.nn.Module, config: CaptureConfig, dynamic: dict[str, int] | None):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"piecewise.compile expects a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.config = config
        self._parameters = list(inspect.signature(model.forward).parameters.values())
        self._names = [p.name for p in self._parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not self._names:
            raise ValueError("piecewise.compile: the model's forward takes no positional arguments to carry tokens")
        self._dynamic = self._check_dynamic(dynamic)
        self._dynamic_given = dynamic is not None
        self._late: set[str] = set()
        """Tensor arguments first given after the first call (optional state such as a KV cache): a call may
        leave them out again (None), which is another variant of the trace."""
        self._compiler = make_compiler(config.compiler)
        self.state = CaptureState(max_tokens=config.max_tokens, graphs_enabled=False)
        self.state.on_new_graph = self._on_new_graph
        self._tracer = ForwardTracer(model, self._backend, config.strict)
        self._sizes = config.sizes
        self._prepared = False
        self._static_ptrs: dict[str, int] = {}
        self._input_buffers: dict[tuple, RowBuffer] = {}
        self._aliases: dict[tuple, torch.Tensor] = {}
        self._first_signature: dict[str, Any] | None = None
        self._first_shapes: dict[str, tuple[int, ...]] = {}  # tensor arguments' shapes at the first call
        self._call_arguments: dict[str, Any] = {}
        self._traced_in_call = False
        self._last_arguments: dict[str, Any] | None = None
        self._replaced: str | None = None  # "parameter `x.weight`" once one was replaced after the first call
        self._probe: tuple[torch.Tensor, int] | None = None  # a parameter and its address at the first call
        self.stats: dict[str, Any] = {
            "pieces": 0,
            "splitting_op_calls": 0,
            "eager_writes": 0,
            "capture_sizes": list(self._sizes),
            "captured_sizes": [],
            "graphs": 0,
            "capture_seconds": 0.0,
            "pool_bytes": 0,
            "cuda_graphs": False,
            "replays": 0,
            "fallback_calls": 0,
            "padded_calls": 0,
            "traces": 0,
            "direct_calls": 0,
            "graph_breaks": 0,
            "prewarm_seconds": 0.0,
            "compile_seconds": 0.0,
        }

    # --- arguments ------------------------------------------------------------------------------------

    def _check_dynamic(self, dynamic: dict[str, int] | None) -> dict[str, int] | None:
        if dynamic is None:
            return None  # decided at the first call: see _default_dynamic
        if not isinstance(dynamic, dict) or not dynamic:
            raise ValueError(f"piecewise.compile: dynamic must map argument names to token dims, got {dynamic!r}")
        for name, dim in dynamic.items():
            if name not in self._names:
                raise ValueError(
                    f"piecewise.compile: dynamic names {name!r}, which is not a positional-or-keyword argument "
                    f"of forward; forward takes {self._names}"
                )
            if not isinstance(dim, int) or isinstance(dim, bool):
                raise ValueError(f"piecewise.compile: dynamic[{name!r}] must be an int dimension, got {dim!r}")
        return dict(dynamic)

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        if len(args) > len(self._names):
            raise TypeError(f"forward takes {len(self._names)} positional arguments but {len(args)} were given")
        arguments = dict(zip(self._names, args))
        for name, value in kwargs.items():
            if name in arguments:
                raise TypeError(f"forward got multiple values for argument {name!r}")
            arguments[name] = value
        return arguments

    def _default_dynamic(self, arguments: dict[str, Any]) -> dict[str, int]:
        """Dim 0 of the first argument, and of every other 1-D or 2-D tensor argument of the same length
        at the first call (positions, slot mappings). Larger tensors (KV caches) stay static."""
        first = arguments.get(self._names[0])
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            raise ValueError(
                f"piecewise: the first forward argument {self._names[0]!r} carries the tokens by default and must "
                f"be a tensor with a token dimension 0; pass dynamic={{'name': 0, ...}} to name the token arguments"
            )
        chosen = {self._names[0]: 0}
        for name, value in arguments.items():
            if name not in chosen and isinstance(value, torch.Tensor) and 1 <= value.dim() <= 2:
                if value.shape[0] == first.shape[0]:
                    chosen[name] = 0
        logger.info("piecewise: token arguments (dim 0): %s", ", ".join(chosen))
        return chosen

    @property
    def token_arguments(self) -> dict[str, int] | None:
        """Forward arguments that carry the token dimension (known after the first call without dynamic=)."""
        return None if self._dynamic is None else dict(self._dynamic)

    def _token_count(self, arguments: dict[str, Any]) -> int:
        if self._dynamic is None:
            self._dynamic = self._default_dynamic(arguments)
        count = None
        for name, dim in self._dynamic.items():
            value = arguments.get(name)
            if value is None and name in self._late:
                continue
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"piecewise: token argument {name!r} must be a tensor, got {type(value).__name__}"
                )
            if not -value.dim() <= dim < value.dim():
                raise ValueError(
                    f"piecewise: token dimension {dim} of argument {name!r} is out of range for shape "
                    f"{tuple(value.shape)}"
                )
            if dim not in (0, -value.dim()):
                raise ValueError(
                    f"piecewise: token dimension of {name!r} is {dim}; only dimension 0 is supported: "
                    f"move the token dimension first"
                )
            rows = value.shape[0]
            if count is not None and rows != count:
                raise ValueError(
                    f"piecewise: token arguments disagree: {name!r} has {rows} tokens, others {count}"
                )
            count = rows
        if count == 0:
            raise ValueError("piecewise: called with 0 tokens; call with at least one token")
        return count

    def _adopt_late(self, arguments: dict[str, Any], tokens: int) -> None:
        """A tensor first given after the first call (None before) follows the first call's rules: a token
        argument (slot mappings: padded and staged per call), or a static tensor read and written in place."""
        for name, value in arguments.items():
            if not isinstance(value, torch.Tensor) or name in self._dynamic or name in self._static_ptrs:
                continue
            self._late.add(name)
            if not self._dynamic_given and 1 <= value.dim() <= 2 and value.shape[0] == tokens:
                self._dynamic[name] = 0
            else:
                self._static_ptrs[name] = value.data_ptr()
                self.state.stable_ptrs.add(value.data_ptr())

    def _check_static(self, arguments: dict[str, Any]) -> None:
        for name, pointer in self._static_ptrs.items():
            value = arguments.get(name)
            if value is None and name in self._late:
                continue
            if not isinstance(value, torch.Tensor):
                given = "not given" if name not in arguments else f"a {type(value).__name__}"
                raise ValueError(
                    f"piecewise: static argument {name!r} was a tensor at capture and is {given} now. Captured "
                    f"graphs read it in place: pass the same tensor on every call, or compile a separate runner "
                    f"for calls without it"
                )
            if value.data_ptr() != pointer:
                raise ValueError(
                    f"piecewise: static argument {name!r} is not the tensor seen at capture (its storage moved). "
                    f"Captured graphs read static arguments in place: write new contents into the same tensor "
                    f"({name}.copy_(new)), mark it as a token argument with dynamic={{...}}, or compile again"
                    + self._batch_first_hint(name)
                )

    def _batch_first_hint(self, name: str) -> str:
        """For a static argument that had one row per entry of dimension 1 of a token argument shaped [1, n] at the
        first call: the usual cause is a batch-first call (gpt-fast, transformers' [batch, seq] inputs)."""
        shapes = self._first_shapes
        static = shapes.get(name, ())
        for token_name in self._dynamic:
            tokens = shapes.get(token_name, ())
            if len(tokens) >= 2 and tokens[0] == 1 and static and static[0] == tokens[1] != 1:
                return (
                    f". At the first call {name!r} had {static[0]} rows and {token_name!r} shape {tokens}: piecewise "
                    f"takes dimension 0 as the token dimension, so that call had 1 token. If {token_name!r} is "
                    f"[batch, tokens], pass the tokens in dimension 0 and compile again"
                )
        return ""

    # --- the call -------------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs) -> Any:
        if self._probe is not None and self._probe[0].data_ptr() != self._probe[1]:
            self._replaced = self._replaced or "the model's parameters moved (model.to(), .half() or .cuda())"
        if self._replaced is not None:
            raise ValueError(
                f"piecewise: {self._replaced} after the first call. The trace and the captured graphs read "
                f"parameters and buffers where they were, so they would go on computing with the old ones. Write "
                f"new values in place (param.copy_(new), model.load_state_dict(state) without assign=True), or "
                f"compile the model again."
            )
        arguments = self._bind(args, kwargs)
        tokens = self._token_count(arguments)
        if self._prepared:
            self._adopt_late(arguments, tokens)
        self._check_static(arguments)
        self._last_arguments = arguments
        _calls_in_progress.append(self)
        try:
            with torch.no_grad():
                if not self._prepared:
                    self._prepare(arguments)
                if tokens > self.config.max_tokens:
                    return self._run_direct(arguments)
                return self._run_padded(arguments, tokens)
        finally:
            _calls_in_progress.pop()

    def _given_tokens(self, arguments: dict[str, Any]) -> list[str]:
        """The token arguments this call passes (late ones may be left out)."""
        return [name for name in self._dynamic if arguments.get(name) is not None]

    def _run_direct(self, arguments: dict[str, Any]) -> Any:
        state = self.state
        state.phase = DIRECT
        for name in self._given_tokens(arguments):
            _compat.mark_token_dim(arguments[name], 0)
        self.stats["fallback_calls"] += 1
        tokens = arguments[next(iter(self._dynamic))].shape[0]
        with forward_context(tokens, tokens):
            return self._call_compiled(arguments)

    def _run_padded(self, arguments: dict[str, Any], tokens: int) -> Any:
        state = self.state
        size = self._sizes[bisect.bisect_left(self._sizes, tokens)]
        staged = self._stage(arguments, tokens, size)
        state.phase = REPLAY if state.capture_done else PADDED
        state.size, state.num_tokens = size, tokens
        state.token_outputs.clear()
        self.stats["padded_calls"] += 1
        with forward_context(tokens, size):
            output = self._call_compiled(staged)
        return self._finish(output, tokens, size)

    def _call_compiled(self, arguments: dict[str, Any]) -> Any:
        state = self.state
        state.splitting_op_calls = 0
        self._traced_in_call = False
        replays = state.replays
        try:
            output = self._tracer((), arguments)
        finally:
            state.phase = DIRECT
        if self._traced_in_call:
            self.stats["traces"] += 1
        self.stats["splitting_op_calls"] = state.splitting_op_calls
        self.stats["replays"] += state.replays - replays
        self.stats["direct_calls"] = self._tracer.direct_calls
        return output

    def _stage(self, arguments: dict[str, Any], rows: int, size: int) -> dict[str, Any]:
        """Copy token arguments into static buffers padded to ``size`` (pad rows zero)."""
        staged = dict(arguments)
        for name in self._given_tokens(arguments):
            value = arguments[name]
            key = (name, value.dtype, value.device, value.shape[1:])
            staging = self._input_buffers.get(key)
            if staging is None:
                buffer = torch.zeros((self.config.max_tokens, *value.shape[1:]), dtype=value.dtype, device=value.device)
                staging = self._input_buffers[key] = RowBuffer(buffer)
                self.state.stable_ptrs.add(buffer.data_ptr())
            staging.write(value, rows)
            alias = self._aliases.get((key, size))
            if alias is None:
                alias = _compat.storage_alias(staging.buffer, size)
                _compat.mark_token_dim(alias, 0)
                self._aliases[(key, size)] = alias
            staged[name] = alias
        return staged

    def _finish(self, output: Any, tokens: int, size: int, clone: bool | None = None) -> Any:
        token_ids = self.state.token_outputs
        clone = self.config.clone_outputs if clone is None else clone

        def fix(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            token = token_ids.get(id(value))
            if token is None:  # not from a symbolic graph (Python after a break): go by the padded length
                token = value.dim() > 0 and value.shape[0] == size
            if token and tokens != size:
                value = value[:tokens]
            return value.clone() if clone else value

        if isinstance(output, torch.Tensor):  # the usual case, without the pytree walk
            return fix(output)
        return torch.utils._pytree.tree_map(fix, output)

    # --- first call: warm-up, trace, capture ---------------------------------------------------------------

    def _prepare(self, arguments: dict[str, Any]) -> None:
        self._prepared = True
        _watch(self)
        first = next(iter(self.model.parameters()), None)
        self._probe = (first, first.data_ptr()) if first is not None else None
        model_tensors = [*self.model.parameters(), *self.model.buffers()]
        for name, value in arguments.items():
            if isinstance(value, torch.Tensor) and name not in self._dynamic:
                self._static_ptrs[name] = value.data_ptr()
        self._first_shapes = {n: tuple(v.shape) for n, v in arguments.items() if isinstance(v, torch.Tensor)}
        self.state.stable_ptrs.update(t.data_ptr() for t in model_tensors)
        self.state.stable_ptrs.update(self._static_ptrs.values())
        self._first_signature = self._signature(arguments)
        started = time.perf_counter()
        tokens = arguments[next(iter(self._dynamic))].shape[0]
        with forward_context(tokens, tokens, rehearsal=True):
            self.model(**arguments)  # eager warm-up: JIT builds and lazy op schemas happen outside tracing
        self.stats["prewarm_seconds"] = time.perf_counter() - started
        devices = {t.device.type for t in model_tensors} | {arguments[n].device.type for n in self._dynamic}
        use_graphs = self.config.cuda_graphs and "cuda" in devices and torch.cuda.is_available()
        self.state.graphs_enabled = use_graphs
        self.stats["cuda_graphs"] = use_graphs
        try:
            self._check_padding(arguments)
        except ForwardRefused:
            self._prepared = False  # the next call checks again (and fails the same way)
            raise
        if not use_graphs:
            reason = "disabled by CaptureConfig(cuda_graphs=False)" if not self.config.cuda_graphs else "no CUDA"
            logger.info("piecewise: pieces run without CUDA graphs (%s)", reason)
            return
        self._capture(arguments)

    def _check_padding(self, arguments: dict[str, Any]) -> None:
        """Run the first call's leading tokens padded by one row twice (after a run that traces), the padding
        rows zero and then copies of real rows. A forward whose pieces compute each row from that row alone
        (attention and other cross-token code in splitting ops) gives the same real rows both times; one that
        mixes rows (a sum or softmax over the tokens, ``x[-1]``) would return padding-dependent numbers on
        every padded call: refused here."""
        sizes = [size for size in self._sizes if size >= 2]
        if not sizes:
            return
        size = sizes[0]
        given = self._given_tokens(arguments)
        rows = min(arguments[given[0]].shape[0], size - 1)
        state = self.state
        results = []
        direct_calls = self._tracer.direct_calls  # the check's calls are not the user's
        rng = _RandomState()  # both compared runs draw the same random numbers: only the padding differs
        for fill in ("trace", "zeros", "copies"):  # tracing may draw random numbers itself: a run before
            rng.restore()
            staged = self._stage({**arguments, **{n: arguments[n][:rows] for n in given}}, rows, size)
            if fill == "copies":
                for name in given:
                    value = arguments[name]
                    staging = self._input_buffers[(name, value.dtype, value.device, value.shape[1:])]
                    source = torch.arange(size - rows, device=value.device) % rows
                    staging.buffer[rows:size] = staging.buffer[source]
                    staging.dirty = max(staging.dirty, size)
            state.phase, state.size, state.num_tokens = PADDED, size, rows
            state.token_outputs.clear()
            with forward_context(rows, size, rehearsal=True):
                output = self._call_compiled(staged)
            results.append(self._finish(output, rows, size, clone=True))
        self._tracer.direct_calls = self.stats["direct_calls"] = direct_calls
        for index, (zeros, copies) in enumerate(zip(*(torch.utils._pytree.tree_leaves(r) for r in results[1:]))):
            if not isinstance(zeros, torch.Tensor) or zeros.is_complex():
                continue
            if zeros.is_floating_point():
                difference = float((zeros.double() - copies.double()).norm() / zeros.double().norm().clamp_min(1e-30))
                tolerance = 1e-4 if zeros.dtype in (torch.float32, torch.float64) else 1e-2
            else:  # token ids, counts, masks: equal or not
                difference, tolerance = float((zeros != copies).double().mean()) if zeros.numel() else 0.0, 0.0
            if not difference <= tolerance:  # NaN included
                hint, chain = self._mixing_hint()
                raise ForwardRefused(
                    f"piecewise: the forward mixes tokens: with {rows} real token(s) padded to {size}, output "
                    f"{index} (shape {tuple(zeros.shape)}) changes by {difference:.1e} (relative) when the padding "
                    f"rows hold other values. Every call is padded to a capture size, so its results would depend "
                    f"on the padding. Code outside splitting ops reads rows other than its own: a sum, mean, "
                    f"softmax, cumsum or sort over the token dimension, or indexing such as x[-1].{hint} "
                    f"Make that code a splitting op (piecewise.opaque_op(..., split=True)), which sees only the "
                    f"real rows, or move it out of forward.",
                    "token_mixing", chain,
                )

    def _mixing_hint(self) -> tuple[str, list[traceback.FrameSummary]]:
        """Where the traced pieces may combine token rows (see ``split.token_mixing_nodes``): a sentence naming
        up to five ``file:line`` places, and the first one's call chain."""
        import linecache

        places, chain = [], []
        for runner in self.state.graph_runners:
            for piece in runner.pieces:
                for node in token_mixing_nodes(piece.graph_module):
                    where = user_line(node)
                    if where and where not in places:
                        places.append(where)
                        chain = chain or _node_chain(node)
        if not places:
            return "", []
        shown = []
        for where in places[:5]:
            path, _, line = where.rpartition(":")
            code = linecache.getline(path, int(line)).strip()
            shown.append(f"{where}" + (f" (`{code}`)" if code else ""))
        return " Candidates: " + "; ".join(shown) + ".", chain

    def capture(self, *args, **kwargs) -> None:
        """Warm up, trace and capture every size now (with these example inputs, or the last call's)."""
        if args or kwargs:
            arguments = self._bind(args, kwargs)
            self._token_count(arguments)
        elif self._last_arguments is not None:
            arguments = self._last_arguments
        else:
            raise ValueError("PiecewiseModel.capture() needs example inputs: call it with the model's arguments")
        if self._prepared:
            return
        self._last_arguments = arguments
        with torch.no_grad():
            self._prepare(arguments)

    def _capture(self, arguments: dict[str, Any]) -> None:
        state = self.state
        tokens = arguments[next(iter(self._dynamic))].shape[0]
        state.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        started = time.perf_counter()
        gc.collect()
        gc.freeze()  # no collection during capture: a collected CUDA tensor would free memory mid-capture
        try:
            with torch.cuda.stream(stream), _progress() as progress:
                task = progress.add_task("capturing CUDA graphs", total=len(self._sizes)) if progress else None
                for size in reversed(self._sizes):
                    rows = min(tokens, size)
                    staged = self._stage({**arguments, **{n: arguments[n][:rows] for n in self._dynamic}}, rows, size)
                    state.size, state.num_tokens = size, rows
                    for phase in (PADDED, CAPTURE):
                        state.phase = phase
                        state.token_outputs.clear()
                        with forward_context(rows, size, capturing=phase == CAPTURE, rehearsal=True):
                            self._call_compiled(staged)
                    for piece in state.captured_this_size:
                        piece.release_outputs(size)
                    if state.captured_this_size:
                        self.stats["captured_sizes"].append(size)
                    state.captured_this_size.clear()
                    if progress:
                        progress.advance(task)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
        finally:
            gc.unfreeze()
            state.phase = DIRECT
        state.capture_done = True
        self.stats["captured_sizes"].sort()
        self.stats["graphs"] = sum(len(p.graphs) for r in state.graph_runners for p in r.pieces)
        self.stats["capture_seconds"] = time.perf_counter() - started
        self.stats["pool_bytes"] = _compat.graph_pool_bytes(state.pool) or 0

    def release_graphs(self) -> None:
        """Destroy every captured CUDA graph and the memory pool they share; later calls run the same pieces
        padded, without graphs (same outputs, ``stats["cuda_graphs"]`` False).

        Call it before ``torch.distributed.destroy_process_group()`` when collectives were captured in the
        graphs (``capture_all_reduce=True``): NCCL holds each communicator open until every graph that
        captured one of its collectives is destroyed, so destroying the group first never returns."""
        state = self.state
        if state.pool is not None:
            torch.cuda.synchronize()
        for runner in state.graph_runners:
            runner.graphs_allowed = False
            for piece in runner.pieces:
                piece.graphs.clear()
                piece.outputs.clear()
        state.pool = None
        state.graphs_enabled = False
        self.stats.update(cuda_graphs=False, graphs=0, captured_sizes=[], pool_bytes=0)

    def __enter__(self) -> "PiecewiseModel":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release_graphs()

    # --- tracing --------------------------------------------------------------------------------------

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list) -> GraphRunner:
        failures = _compat.token_guard_failures(example_inputs, self._sizes)
        if failures and {size for _, _, size in failures} == {1} and len(self._sizes) > 1 and self.stats["traces"] == 0 \
                and not self.state.capture_done:
            # The trace assumes more than one token (a broadcasting check in indexing or copy_, DeepSeek-V3's
            # key assembly): one-token calls are padded to the next size instead, where the graph is valid.
            condition, where, _ = failures[0]
            logger.info("piecewise: the trace assumes more than one token (`%s` at %s): calls of one token are "
                        "padded to %d", condition, where, self._sizes[1])
            self._sizes = [size for size in self._sizes if size != 1]
            self.stats["capture_sizes"] = list(self._sizes)
            failures = []
        if failures:
            condition, where, size = failures[0]
            hint = ""
            if size == 1 and re.fullmatch(r"(Ne|Eq)\(\w+,1\)", condition.replace(" ", "")):
                hint = (" A check against one token usually comes from broadcasting, e.g. in `x[index] = values`: "
                        "`x.index_copy_(0, index, values)` or `x.index_put_((index,), values)` trace without it.")
            located = re.search(r"# (\S+):(\d+) in (\w+)", where)
            raise ForwardRefused(
                f"piecewise: the forward depends on the token count: it evaluates `{condition}` at {where}, "
                f"which is false for capture size {size}. One trace serves every token count, so the forward "
                f"must not branch on it: move the branch out of forward, or make that code a splitting op "
                f"(piecewise.opaque_op(..., split=True)).{hint}",
                "token_branch",
                [traceback.FrameSummary(located[1], int(located[2]), located[3])] if located else [],
            )
        token_inputs = [node for node in graph.graph.nodes
                        if node.op == "placeholder" and is_token_tensor(node.meta.get("example_value"))]
        for writer, placeholder in writes_to_inputs(graph, token_inputs):
            what = op_name(writer.target) or f".{writer.target}()"
            raise ForwardRefused(
                f"piecewise: {what} writes in place into {_compat.argument_source(placeholder)}, which piecewise "
                f"takes for a token argument (its dimension 0 has the call's token count). Token arguments are "
                f"copied into padded buffers on every call, so the write would be lost. If it is state kept "
                f"across calls (a cache whose first dimension happens to equal the token count), compile with "
                f"dynamic={{...}} naming only the real token arguments; token arguments: {list(self._dynamic)}.",
                "token_argument_write", _node_chain(writer),
            )
        splitting = frozenset(self.config.splitting_ops) if self.config.splitting_ops is not None else splitting_op_names()
        return GraphRunner(graph, self.state, self._compiler, splitting, self._static_writes(graph, token_inputs, splitting))

    def _static_writes(self, graph: torch.fx.GraphModule, token_inputs: list, splitting: frozenset[str]) -> dict:
        """In-place writes of traced code into static tensors (arguments, parameters, buffers) → a label each.

        Such a write runs eagerly between pieces, on the real rows: inside a piece it would also run for the
        padding rows (a KV-cache write at the padded positions would overwrite position 0). A write that reads
        what it overwrites (``+=``, ``add_``) is refused: the first call runs the model several times."""
        static = [node for node in graph.graph.nodes if node.op == "placeholder" and node not in token_inputs
                  and isinstance(node.meta.get("example_value"), torch.Tensor)]
        eager: dict = {}
        for writer, placeholder in writes_to_inputs(graph, static):
            if writer in eager or (writer.op == "call_function" and op_name(writer.target) in splitting):
                continue
            what, target, where = describe_write(writer), _compat.argument_source(placeholder), user_line(writer)
            if accumulates(writer):
                raise ForwardRefused(
                    f"piecewise: {what} at {where or 'an unknown line'} updates {target} in place from its own "
                    f"value. The first call runs the model several times on its inputs (warm-up, then one run per "
                    f"capture size), so the update would be applied more than once. Keep such state out of the "
                    f"traced forward, or move the update into a splitting op "
                    f"(piecewise.opaque_op(..., split=True)) that skips it while piecewise.context().rehearsal is "
                    f"True.",
                    "state_update", _node_chain(writer),
                )
            eager[writer] = f"{what} into {target}" + (f" ({where})" if where else "")
        if eager:
            logger.info(
                "piecewise: %d in-place write(s) into static tensors run eagerly between pieces, on the real rows "
                "only (%s); a KV-cache write inside an attention splitting op avoids the extra cut",
                len(eager), "; ".join(eager.values()),
            )
        return eager

    def _on_new_graph(self, runner: GraphRunner) -> None:
        self._traced_in_call = True
        self.stats["compile_seconds"] += runner.compile_seconds
        if self.state.capture_done or self.stats["traces"] > 0:
            if self.state.capture_done:
                runner.graphs_allowed = False
            if self._tracer.graph_breaks:
                return  # code after a graph break is traced per new shape once; the break was reported
            change = self._describe_change()
            warnings.warn(
                f"piecewise: the model was traced again after the first trace ({change}); the new graph runs "
                f"without CUDA graphs. Call the model with the argument types it was captured with, or compile "
                f"a separate runner for this variant.",
                stacklevel=6,
            )
            return
        self.stats["pieces"] += len(runner.pieces)
        self.stats["eager_writes"] += len(runner.eager_writes)
        self.stats["graph_breaks"] = len(self._tracer.blockers) if self._tracer.graph_breaks else 0

    def _signature(self, arguments: dict[str, Any]) -> dict[str, Any]:
        def describe(name: str, value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                shape = list(value.shape)
                if name in self._dynamic:
                    shape[0] = "tokens"
                return (value.dtype, value.device.type, tuple(shape))
            return repr(value)

        return {name: describe(name, value) for name, value in arguments.items()}

    def _describe_change(self) -> str:
        if self._first_signature is None or self._last_arguments is None:
            return "unknown change"
        now = self._signature(self._last_arguments)
        changes = [
            f"argument {name!r}: {self._first_signature.get(name)} -> {now.get(name)}"
            for name in sorted(set(now) | set(self._first_signature))
            if now.get(name) != self._first_signature.get(name)
        ]
        return "; ".join(changes) if changes else "a guard on model state failed"


def compile(
    model: torch.nn.Module, config: CaptureConfig | None = None, *, dynamic: dict[str, int] | None = None
) -> PiecewiseModel:
    """Make ``model`` run as piecewise CUDA graphs.

    ``dynamic`` maps forward argument names to their token dimension (only dimension 0 is supported);
    default: dimension 0 of the first forward argument. Every other tensor argument is static: it must be
    the same storage on every call (KV caches), or the call raises ``ValueError`` naming it.
    """
    return PiecewiseModel(model, config if config is not None else CaptureConfig(), dynamic)


def trial_capture(model: torch.nn.Module, args: tuple, kwargs: dict) -> list:
    """Run the runtime's first call on these inputs (capture sizes 1, 2 and the inputs' token count; CUDA
    graphs where the model is on CUDA) and return what it refuses as doctor blockers: ``capture_illegal`` (CUDA
    only), ``token_mixing``, ``token_branch``, ``state_update``, ``token_argument_write``.

    Used by ``piecewise.doctor``. The model runs several times on the inputs, as on a first call.
    """
    from .cudagraph import CaptureFailed
    from .diagnostics.blockers import Blocker, Frame
    from .diagnostics.classify import FIXES

    runner = PiecewiseModel(model, CaptureConfig(max_tokens=512), None)
    arguments = runner._bind(tuple(args), dict(kwargs))
    tokens = runner._token_count(arguments)
    runner.config = CaptureConfig(capture_sizes=sorted({1, 2, tokens}), max_tokens=max(tokens, 2))
    runner._sizes = runner.config.sizes
    runner.state.max_tokens = runner.config.max_tokens
    runner.stats["capture_sizes"] = list(runner._sizes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # graph breaks: the doctor reports them from its own trace
            runner(*args, **kwargs)
    except CaptureFailed as exc:
        chain = [Frame.from_summary(frame) for frame in (_node_chain(exc.node) if exc.node is not None else [])]
        return [Blocker(kind="capture_illegal", message=str(exc), chain=chain, fix=FIXES["capture_illegal"])]
    except ForwardRefused as exc:
        chain = [Frame.from_summary(frame) for frame in exc.chain]
        message = str(exc).removeprefix("piecewise: ")
        return [Blocker(kind=exc.kind, message=message, chain=chain, fix=FIXES[exc.kind])]
    finally:
        runner.release_graphs()
    return []
