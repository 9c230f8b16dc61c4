"""Capture and replay: each piece gets one CUDA graph per capture size; splitting ops run eagerly between.

Invariants that make replay correct:
- every tensor a captured piece reads lives at a fixed address: static buffers (model inputs, splitting-op
  outputs, inputs produced by Python between graph breaks), parameters, static arguments, or outputs of
  earlier pieces of the same size;
- pieces replay in capture order, so memory the shared pool reused during capture is live at replay exactly
  when it was live during capture; piece outputs are kept as non-owning aliases so sizes share the pool;
- splitting ops see only the real rows, and rows past them in their output buffers are zero.
"""

from __future__ import annotations

import logging
import operator
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _compat
from .compilers import PieceCompiler
from .opaque import op_name, opaque_op_info
from .split import split_graph

logger = logging.getLogger(__name__)

# Phases of one call.
DIRECT = "direct"  # no padding, no graphs (above max_tokens, or outside a piecewise call)
PADDED = "padded"  # padded to the capture size, pieces run without graphs (CPU, warm-up, no graph yet)
CAPTURE = "capture"  # padded; each piece records its graph for this size, then replays it once
REPLAY = "replay"  # padded; each piece replays its graph for this size


@dataclass
class CaptureState:
    """What the runners of one compiled model share during a call."""

    max_tokens: int
    graphs_enabled: bool
    phase: str = DIRECT
    size: int = 0
    num_tokens: int = 0
    pool: Any = None
    capture_done: bool = False
    stable_ptrs: set[int] = field(default_factory=set)
    """Addresses that never move: parameters, buffers, static arguments, piecewise's input buffers."""
    token_outputs: dict[int, bool] = field(default_factory=dict)
    """id of each tensor a graph returned in this call → whether it carries the token dimension."""
    graph_runners: list["GraphRunner"] = field(default_factory=list)
    captured_this_size: list["PieceRunner"] = field(default_factory=list)
    replays: int = 0
    splitting_op_calls: int = 0
    on_new_graph: Callable[["GraphRunner"], None] | None = None


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in _flat_tensors(item)]
    return []


def is_token_tensor(fake: Any) -> bool:
    return isinstance(fake, torch.Tensor) and fake.dim() > 0 and _compat.is_plain_symbol(fake.shape[0])


def token_dim(fake: Any) -> int | None:
    """The first dimension of ``fake`` that is the token count (None: not a token tensor)."""
    if not isinstance(fake, torch.Tensor):
        return None
    return next((d for d, size in enumerate(fake.shape) if _compat.is_plain_symbol(size)), None)


def _placeholder_values(module: torch.fx.GraphModule) -> list[Any]:
    return [node.meta.get("example_value") for node in module.graph.nodes if node.op == "placeholder"]


def _output_values(module: torch.fx.GraphModule) -> Any:
    output = next(node for node in reversed(module.graph.nodes) if node.op == "output")
    return torch.fx.node.map_arg(output.args[0], lambda node: node.meta.get("example_value"))


class CaptureFailed(RuntimeError):
    """An operation inside a piece is illegal during CUDA-graph capture."""

    def __init__(self, message: str, node: torch.fx.Node | None):
        super().__init__(message)
        self.node = node


class PieceRunner:
    """One compiled piece: runs it, captures it per size, replays it."""

    def __init__(self, name: str, graph: torch.fx.GraphModule, compiled: Callable, state: CaptureState, owner):
        self.name = name
        self.graph_module = graph
        self.compiled = compiled
        self.state = state
        self.owner = owner
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Any] = {}

    def __call__(self, *args):
        state = self.state
        phase = state.phase
        if phase == REPLAY:
            graph = self.graphs.get(state.size)
            if graph is not None:
                graph.replay()
                state.replays += 1
                return self.outputs[state.size]
        elif phase == CAPTURE and self.owner.graphs_allowed:
            return self._capture(args)
        return self.compiled(*args)

    def _capture(self, args: tuple) -> Any:
        size = self.state.size
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.state.pool)
        try:
            output = self.compiled(*args)
        except Exception as exc:
            try:
                _end_capture(graph)
            except Exception:
                pass
            torch.cuda.synchronize()
            raise self._explain_failure(exc, args) from exc
        if _end_capture(graph):
            graph.replay()  # give the outputs real values: the splitting op after this piece reads them
            self.graphs[size] = graph
            self.outputs[size] = output
            self.state.captured_this_size.append(self)
        # else: the piece launched no kernel (views only); it keeps running eagerly, which costs no launch
        return output

    def release_outputs(self, size: int) -> None:
        """Swap this size's outputs for non-owning aliases so the pool can reuse them for other sizes."""
        self.outputs[size] = _map_tensors(self.outputs[size], _compat.non_owning_alias)

    def _explain_failure(self, exc: Exception, args: tuple) -> CaptureFailed:
        node = find_capture_illegal_node(self.graph_module, args, self.state.pool)
        where = ""
        if node is not None:
            trace = (node.meta.get("stack_trace") or "").strip().splitlines()
            frame = next((line.strip() for line in reversed(trace) if line.strip().startswith("File ")), "")
            where = f" at `{node.format_node()}`" + (f" ({frame})" if frame else "")
        return CaptureFailed(
            f"piecewise [capture_illegal]: {self.name} cannot be captured as a CUDA graph{where}: {exc}. "
            f"Operations that synchronise the host (tensor.item(), .cpu(), .tolist(), blocking copies, "
            f"torch.cuda.synchronize) cannot run inside a captured piece: move them out of forward, or make "
            f"the code a splitting op with piecewise.opaque_op(..., split=True) so it runs eagerly.",
            node,
        )


_EMPTY_GRAPH = "The CUDA Graph is empty"


def _end_capture(graph: torch.cuda.CUDAGraph) -> bool:
    """End ``graph``'s capture; False when it recorded nothing. torch's warning about an empty graph is kept
    from the user (an empty piece is expected: one made of views only); any other warning is passed on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph.capture_end()
    empty = False
    for warning in caught:
        if str(warning.message).startswith(_EMPTY_GRAPH):
            empty = True
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return not empty


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    return value


def find_capture_illegal_node(graph: torch.fx.GraphModule, args: tuple, pool: Any) -> torch.fx.Node | None:
    """Run ``graph`` node by node, each node under its own trial capture; return the first that fails."""
    env: dict[torch.fx.Node, Any] = {}
    arg_iter = iter(args)
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(arg_iter)
            continue
        if node.op == "output":
            return None
        node_args = torch.fx.node.map_arg(node.args, lambda n: env[n])
        node_kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
        if node.op == "get_attr":
            env[node] = getattr(graph, node.target)
            continue
        target = getattr(graph, node.target) if node.op == "call_module" else node.target
        trial = torch.cuda.CUDAGraph()
        try:
            trial.capture_begin(pool=pool)
            try:
                if node.op == "call_method":
                    env[node] = getattr(node_args[0], node.target)(*node_args[1:], **node_kwargs)
                else:
                    env[node] = target(*node_args, **node_kwargs)
            finally:
                _end_capture(trial)
        except Exception:
            torch.cuda.synchronize()
            return node
    return None


class RowBuffer:
    """A static [max_tokens, ...] buffer written by leading rows; rows past the last write read zero.

    Views of its leading rows are made once per row count: on replay the same counts come back every step.
    """

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.views: dict[int, torch.Tensor] = {}
        self.dirty = 0

    def rows(self, count: int) -> torch.Tensor:
        view = self.views.get(count)
        if view is None:
            view = self.views[count] = self.buffer[:count]
        return view

    def write(self, value: torch.Tensor, rows: int) -> None:
        """Copy ``value`` into the first ``rows`` rows; zero the rows a larger earlier write left behind."""
        self.rows(rows).copy_(value)
        if self.dirty > rows:
            self.buffer[rows : self.dirty].zero_()
        self.dirty = rows


class SplitOpRunner:
    """One splitting op: runs eagerly on the real rows, writes into static buffers the next piece reads."""

    def __init__(self, name: str, module: torch.fx.GraphModule, op_name: str, state: CaptureState,
                 any_dim: bool = False):
        self.name = name
        self.module = module
        self.op_name = op_name
        self.state = state
        # Splitting ops take tokens in dimension 0. An in-place write cut out of the pieces (any_dim) may take
        # them in another (a [batch, heads, tokens, dim] cache write): its inputs are cut along that dimension.
        values = _placeholder_values(module)
        self.token_dims = [token_dim(v) if any_dim else (0 if is_token_tensor(v) else None) for v in values]
        self.token_inputs = [d is not None for d in self.token_dims]
        outputs = _output_values(module)
        self.single_output = not isinstance(outputs, (tuple, list))
        flat = [outputs] if self.single_output else list(outputs)
        self.token_outputs = [is_token_tensor(v) for v in flat]
        self.buffers: list[torch.Tensor | None] = [None] * len(flat)
        self.row_buffers: list[RowBuffer | None] = [None] * len(flat)
        self.sliced: dict[tuple[int, int], tuple[tuple, list]] = {}
        self.call = self._direct_call(module) or module.forward

    @staticmethod
    def _direct_call(module: torch.fx.GraphModule) -> Callable | None:
        """For piecewise's own opaque ops: call the Python body directly (the partition is one op call),
        skipping the dispatcher, which costs more than a small op itself."""
        nodes = [n for n in module.graph.nodes if n.op not in ("placeholder", "output")]
        if len(nodes) != 1 or nodes[0].op != "call_function":
            return None
        info = opaque_op_info(op_name(nodes[0].target) or "")
        if info is None or info.impl is None:
            return None
        output = next(n for n in module.graph.nodes if n.op == "output")
        if output.args[0] is not nodes[0]:
            return None
        placeholders = {n: i for i, n in enumerate(n for n in module.graph.nodes if n.op == "placeholder")}
        node = nodes[0]
        schema_args = node.target._schema.arguments if hasattr(node.target, "_schema") else None
        positional = list(node.args)
        keyword = dict(node.kwargs)
        if schema_args is not None:  # pass everything positionally, in schema order, defaults filled
            values = positional + [keyword.pop(a.name, a.default_value) for a in schema_args[len(positional) :]]
            positional, keyword = values, {}
        getters = [(placeholders[a], None) if isinstance(a, torch.fx.Node) else (None, a) for a in positional]
        if keyword or any(isinstance(a, (list, tuple, dict)) for a in positional):
            return None
        impl = info.impl
        count = len(placeholders)
        if [i for i, _ in getters[:count]] == list(range(count)) and all(i is None for i, _ in getters[count:]):
            # placeholders in order, constants last (the usual shape): no per-call list
            trailing = tuple(const for _, const in getters[count:])

            def call(*args):
                return impl(*args, *trailing)

            return call

        def call(*args):
            return impl(*[args[i] if i is not None else const for i, const in getters])

        return call

    def __call__(self, *args):
        state = self.state
        state.splitting_op_calls += 1
        phase = state.phase
        if phase == DIRECT:
            return self.call(*args)
        rows, size = state.num_tokens, state.size
        call_args = args if rows == size else self._real_rows(args, rows, size, phase == REPLAY)
        result = self.call(*call_args)
        if self.single_output:
            return self._stage(0, result, rows, size, args)
        return tuple(self._stage(i, value, rows, size, args) for i, value in enumerate(result))

    def _real_rows(self, args: tuple, rows: int, size: int, keep: bool) -> list:
        """The first ``rows`` rows of each token argument. On replay the arguments are the same tensors
        every time (piece outputs, static buffers), so the views are made once per (size, rows)."""
        cached = self.sliced.get((size, rows))
        if cached is not None and all(map(operator.is_, cached[0], args)):
            return cached[1]
        call_args = [a if d is None else a[:rows] if d == 0 else a.narrow(d, 0, rows)
                     for a, d in zip(args, self.token_dims)]
        if keep:
            self.sliced[(size, rows)] = (args, call_args)
        return call_args

    def _stage(self, index: int, value: Any, rows: int, size: int, args: tuple) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        token = self.token_outputs[index]
        buffer = self.buffers[index]
        if buffer is None:
            shape = (self.state.max_tokens, *value.shape[1:]) if token else value.shape
            buffer = torch.zeros(shape, dtype=value.dtype, device=value.device)
            self.buffers[index] = buffer
            if token:
                self.row_buffers[index] = RowBuffer(buffer)
            self.state.stable_ptrs.add(buffer.data_ptr())
        elif buffer.dtype != value.dtype or buffer.shape[1 if token else 0 :] != value.shape[1 if token else 0 :]:
            raise RuntimeError(
                f"piecewise: splitting op {self.op_name} returned {tuple(value.shape)} {value.dtype}, but its "
                f"buffer was made for {tuple(buffer.shape)} {buffer.dtype}; the op's output metadata must "
                f"depend only on the token count (check its fake implementation)"
            )
        if not token:
            if any(value is arg for arg in args):  # an in-place op returning the static tensor it wrote
                return value
            buffer.copy_(value)
            return buffer
        rows_buffer = self.row_buffers[index]
        rows_buffer.write(value, rows)
        return rows_buffer.rows(size)


class GraphRunner:
    """What the Dynamo backend returns for one traced graph: the split graph with runners in place."""

    def __init__(
        self,
        graph: torch.fx.GraphModule,
        state: CaptureState,
        compiler: PieceCompiler,
        splitting_ops: frozenset[str],
        eager_writes: dict[torch.fx.Node, str] | None = None,
    ):
        self.state = state
        self.graphs_allowed = state.graphs_enabled and not state.capture_done
        started = time.perf_counter()
        self.eager_writes = list((eager_writes or {}).values())
        """In-place writes into static tensors cut out of the pieces (see ``PiecewiseModel._static_writes``)."""
        self.split_graph, partitions = split_graph(graph, splitting_ops, eager_writes)
        self.pieces: list[PieceRunner] = []
        self.splitting_ops: list[SplitOpRunner] = []
        for partition in partitions:
            if partition.splitting_op is not None:
                runner = SplitOpRunner(partition.name, partition.module, partition.splitting_op, state,
                                       any_dim=partition.splitting_op not in splitting_ops)
                self.splitting_ops.append(runner)
            else:
                compiled = compiler.compile(partition.module, _placeholder_values(partition.module))
                runner = PieceRunner(partition.name, partition.module, compiled, state, self)
                self.pieces.append(runner)
            # A plain attribute, not a submodule: the split graph's code calls it without nn.Module overhead.
            delattr(self.split_graph, partition.name)
            self.split_graph.__dict__[partition.name] = runner
        self.compile_seconds = time.perf_counter() - started
        inputs = _placeholder_values(graph)
        self.token_inputs = [is_token_tensor(v) for v in inputs]
        self.symbolic = any(self.token_inputs)
        outputs = _output_values(graph)
        self.token_outputs = [is_token_tensor(v) for v in (outputs if isinstance(outputs, (tuple, list)) else [outputs])]
        self.external: list[int] | None = None  # inputs that need a static copy; decided on the first call
        self.input_buffers: dict[tuple[int, int], torch.Tensor] = {}
        state.graph_runners.append(self)
        if state.on_new_graph is not None:
            state.on_new_graph(self)

    def __call__(self, *args):
        state = self.state
        if state.phase != DIRECT:
            if self.external is None:
                self.external = [
                    i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.data_ptr() not in state.stable_ptrs
                ]
            if self.external:
                args = self._stage_inputs(list(args))
        outputs = self.split_graph(*args)
        if self.symbolic:  # a graph traced for one static size (after a break) can't tell: leave unknown
            flat = outputs if isinstance(outputs, (tuple, list)) else [outputs]
            for value, token in zip(flat, self.token_outputs):
                if isinstance(value, torch.Tensor):
                    state.token_outputs[id(value)] = token
        return outputs

    def _stage_inputs(self, args: list) -> list:
        """Copy inputs made by Python between graphs into fixed buffers (one per size for odd shapes)."""
        size = self.state.size
        for i in self.external:
            value = args[i]
            token = self.token_inputs[i] and value.shape[0] == size
            key = (i, 0 if token else size)
            buffer = self.input_buffers.get(key)
            fits = buffer is not None and buffer.dtype == value.dtype
            fits = fits and (buffer.shape[1:] == value.shape[1:] if token else buffer.shape == value.shape)
            if not fits:
                shape = (self.state.max_tokens, *value.shape[1:]) if token else value.shape
                buffer = torch.zeros(shape, dtype=value.dtype, device=value.device)
                self.input_buffers[key] = buffer
            target = buffer[:size] if token else buffer
            target.copy_(value)
            args[i] = target
        return args
