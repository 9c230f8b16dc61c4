"""Compiled regions for the breakable front-end (``CaptureConfig(frontend="breakable", compiler="inductor")``).

The forward runs through ``torch.compile`` with graph breaks allowed. Dynamo hands each region it traced (the code
between graph breaks) to ``Regions.backend``, which cuts the region at its splitting ops and at its in-place
writes into static tensors (a KV cache) and compiles what lies between with Inductor, for the symbolic token
count. What Dynamo cannot trace (a JIT library's subprocess and lock) runs as plain Python.

Nothing else changes: the breakable interceptor (a ``TorchDispatchMode`` that ignores compiled internals, so
torch.compile'd code runs compiled under it) still sees every op the compiled code calls through the dispatcher:
the splitting ops and the cut writes, which run eagerly in their own partition, end one graph segment and begin
the next exactly as in an uncompiled forward. The Triton kernels Inductor launches are recorded into the segment
by the stream capture. Under breakable the model's Python, Dynamo's guard checks and graph breaks included, runs
only while the first call captures: a replay runs the recorded segments and calls.

A region whose guards depend on the token count within one padding interval (a branch at 12 tokens when 9..16
pad to 16) is refused: the padded call would take the path of its capture size.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from ..capture.compilers import make_compiler
from ..errors import ForwardRefused
from ..graph.guards import token_guard_failures
from ..graph.split import split_graph
from ..graph.tokens import is_token_tensor, placeholder_values
from .dynamo_trace import fresh_method

logger = logging.getLogger(__name__)

RECOMPILE_LIMIT = 1024
"""Traces per code object. A graph break inside the layers' loop makes Dynamo skip the model's frame and trace
each layer's frames instead, once per layer where a layer's index is a constant of its code (an attention op's
layer argument), and once more per frame when the token count turns dynamic: past Dynamo's default limit (8) the
remaining layers would run uncompiled."""


class Regions:
    """The compiled forward and the regions Dynamo traced in it."""

    def __init__(self, model: torch.nn.Module, compiler: str, splitting: frozenset[str], ladder, stats,
                 static: set[int], stager):
        self.compiler = make_compiler(compiler)
        self.splitting = splitting
        self.ladder = ladder
        self.stats = stats
        self.static = static
        """Storages of the model's parameters and buffers and of its static arguments (the runner's, shared)."""
        self.stager = stager
        self.method = fresh_method(model.forward)  # its own code object: its own Dynamo cache
        _forget_compiled_layers(model)
        self.compiled = torch.compile(self.method, backend=self.backend, fullgraph=False, dynamic=None,
                                      options=_compat.compile_options(graph_breaks=True))
        self.key = (compiler, splitting)
        self.used: set[Region] = set()

    def __call__(self, arguments: dict[str, Any]) -> Any:
        for value in arguments.values():  # the token count may be symbolic; Dynamo keeps what it must static
            if isinstance(value, torch.Tensor):
                _compat.soften_token_dims(value)
        _ACTIVE.append(self)
        try:
            with _compat.tracing_patches(), _quiet_dynamo(), torch._dynamo.config.patch(
                    recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=4 * RECOMPILE_LIMIT,
                    allow_unspec_int_on_nn_module=True):
                return self.compiled(**arguments)
        except _compat.BackendCompilerFailed as exc:
            inner = getattr(exc, "inner_exception", None)
            if isinstance(inner, ForwardRefused):  # piecewise's own message: no Dynamo wrapping
                raise inner from None
            raise
        finally:
            _ACTIVE.pop()

    def adopt(self, region: Region) -> None:
        """A region this forward runs for the first time. Dynamo keeps compiled frames on the code object, shared
        by every torch.compile of it: a layer's frame compiled for another runner of the same model class serves
        this one too. It is the same computation when it was cut at the same ops; its guards are checked against
        this runner's ladder."""
        if region.key != self.key:
            raise ForwardRefused(
                f"piecewise: Dynamo reuses a region of this forward compiled for another runner of the same model "
                f"class, cut at other splitting ops or compiled otherwise ({_describe(region.key)} there, "
                f"{_describe(self.key)} here): compile every breakable runner of this class with the same "
                f"splitting_ops and compiler, or use compiler='eager' for this one.", "foreign_region")
        self._check_token_guards(region.example_inputs)
        self.used.add(region)
        self.stats.compiled_regions = len(self.used)

    def backend(self, graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from .dynamo import refuse_token_argument_writes, static_writes

        started = time.perf_counter()
        fakes = placeholder_values(graph)  # with their symbolic sizes (the example inputs may be real tensors)
        self._check_token_guards(fakes)
        token_inputs, static = self._inputs(graph)
        refuse_token_argument_writes(graph, token_inputs)
        writes = static_writes(graph, token_inputs, self.splitting, static)
        split, partitions = split_graph(graph, self.splitting, writes)
        compiled = 0
        for partition in partitions:
            if partition.splitting_op is not None:
                continue  # runs op by op: the interceptor cuts the segment at it
            module = partition.module
            if not any(node.op == "call_function" for node in module.graph.nodes):
                continue
            function = self.compiler.compile(module, placeholder_values(module))
            delattr(split, partition.name)
            split.__dict__[partition.name] = function
            compiled += 1
        self.stats.eager_writes += len(writes)
        self.stats.compile_seconds += time.perf_counter() - started
        self.stats.pieces_shared = self.compiler.shared
        logger.debug("piecewise: region compiled: %d piece(s), %d splitting call(s) or cut write(s)",
                     compiled, len(partitions) - compiled)
        region = Region(self.key, split.forward, fakes,
                        [node.name for node in graph.graph.nodes if node.op == "placeholder"])
        self.used.add(region)  # its guards were checked above: adopt() is for regions other runners compiled
        self.stats.compiled_regions = len(self.used)
        return region

    def _inputs(self, graph: torch.fx.GraphModule) -> tuple[list, list]:
        """(the region's inputs that are the runner's token arguments, those that are static tensors: parameters,
        buffers, static arguments such as a KV cache, and views of them), told apart by their storage. A region
        after a graph break, or a layer's frame, also takes activations Python made: temporaries, which it may
        write in place like any other."""
        tokens, static = [], []
        for node in graph.graph.nodes:
            if node.op != "placeholder" or not isinstance(node.meta.get("example_value"), torch.Tensor):
                continue
            try:
                real = node.meta["grapharg"].example
            except (KeyError, AttributeError, AssertionError):
                real = None
            if not isinstance(real, torch.Tensor):  # unknown: as the one trace judges it
                (tokens if is_token_tensor(node.meta.get("example_value")) else static).append(node)
            elif self.stager.owns(real):
                tokens.append(node)
            elif real.untyped_storage().data_ptr() in self.static:
                static.append(node)
        return tokens, static

    def _check_token_guards(self, example_inputs: list) -> None:
        """Refuse a region whose shape guards change within a padding interval of the ladder: a call of n tokens
        runs the capture of the size it pads to, traced for that size."""
        sizes = self.ladder.sizes
        counts = list(range(1, sizes[-1] + 2))
        failing = {size for _, _, size in token_guard_failures(example_inputs, counts)}
        if not failing:
            return
        lower = 0
        for size in sizes:
            interval = range(lower + 1, size + 1)
            inside = {n in failing for n in interval}
            if len(inside) > 1:
                condition, where, _ = next(f for f in token_guard_failures(example_inputs, list(interval)))
                raise ForwardRefused(
                    f"piecewise: a compiled region of the forward depends on the token count: it evaluates "
                    f"`{condition}` at {where}, which differs between calls of {lower + 1}..{size} tokens, all "
                    f"padded to {size}; the padded call would take the path traced for {size} tokens. Move the branch "
                    f"out of forward, make that code a splitting op (piecewise.opaque_op(..., split=True)), or add the "
                    f"counts where it changes to capture_sizes.", "token_branch")
            lower = size


def _forget_compiled_layers(model: torch.nn.Module) -> None:
    """Clear Dynamo's compiled frames of the model's modules' ``forward`` code. A graph break inside the layers'
    loop makes Dynamo trace each layer's frame on its own, on the code object its class shares with every other
    instance: frames compiled there for another runner (another backend) would leave this one's layers
    uncompiled (Dynamo runs the frame without compiling it again). Another runner of the same class compiles them
    again on its next call through Dynamo (a breakable runner's replays never go through it)."""
    from torch._C._dynamo.eval_frame import reset_code

    codes = {getattr(type(module).forward, "__code__", None) for module in model.modules()}
    for code in codes - {None}:
        reset_code(code)


def dispatch_mode_skips_compile() -> bool:
    """Whether a ``TorchDispatchMode`` on the stack makes Dynamo run compiled functions eagerly (one that does not
    ignore compiled internals). Dynamo then also marks each frame it meets to be skipped for good."""
    from torch.utils._python_dispatch import _get_dispatch_stack_at

    for index in range(torch._C._len_torch_dispatch_stack()):
        mode = _get_dispatch_stack_at(index)
        ignores = getattr(mode, "ignore_compile_internals", None)
        if not (mode.is_infra_mode() if hasattr(mode, "is_infra_mode") else False) and not (ignores and ignores()):
            return True
    return False


_ACTIVE: list[Regions] = []
"""The runners whose forward is running (innermost last)."""


class Region:
    """What the backend returns for one region: its compiled split graph, and what makes it valid for a runner."""

    def __init__(self, key: tuple, function: Callable, example_inputs: list, labels: list[str] | None = None):
        self.key, self.function, self.example_inputs = key, function, example_inputs
        self.labels = labels
        """The inputs' names in Dynamo's graph (``l_self_...``, ``g_context_...``): where each came from."""

    def __call__(self, *args):
        if _ACTIVE and self not in _ACTIVE[-1].used:
            _ACTIVE[-1].adopt(self)
        watcher = _WATCHERS[-1] if _WATCHERS and _INSIDE[0] == 0 else None
        if watcher is not None:  # its inputs: what Dynamo lifted, globals included (``breakable_outside``)
            watcher.check("a compiled region", args, None, self.labels)
        _INSIDE[0] += 1
        try:
            result = self.function(*args)
        finally:
            _INSIDE[0] -= 1
        if watcher is not None:
            watcher.made(result)
        return result


_INSIDE = [0]
_WATCHERS: list = []


@contextlib.contextmanager
def watching_regions(watcher):
    """While a checked run lasts, the compiled regions' inputs and outputs go to ``watcher`` (an
    ``OutsideTensors``; None: nothing watched)."""
    if watcher is None:
        yield
        return
    _WATCHERS.append(watcher)
    try:
        yield
    finally:
        _WATCHERS.pop()


def inside_region() -> bool:
    """Whether a compiled region is running: the ops the interceptor sees then are those its compiled code calls
    (extern kernels, splitting ops, cut writes), which differ between its traces for one size and another; the
    region's own guards say where it depends on the token count (``Regions._check_token_guards``)."""
    return _INSIDE[0] > 0


def _describe(key: tuple) -> str:
    compiler, splitting = key
    return f"compiler={compiler!r}, splitting ops {sorted(splitting)}"


@contextlib.contextmanager
def _quiet_dynamo():
    """Dynamo's recompile and graph-break warnings stay off the user's terminal: the regions are piecewise's to
    report (``stats["compiled_regions"]``, ``doctor``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"torch\._dynamo.*")
        warnings.filterwarnings("ignore", message=r".*(recompile_limit|cache_size_limit|Dynamo).*")
        yield
