"""What the Dynamo backend returns for one traced graph: the graph split at splitting ops, a runner in place of
each partition (a piece captured per size, or a splitting op run eagerly between pieces)."""

from __future__ import annotations

import copy
import time

import torch

from .. import _compat
from ..capture.compilers import SharedCompiles
from ..capture.pieces import PieceRunner
from ..capture.splitop import SplitOpRunner
from ..capture.state import CaptureState, Phase
from ..errors import StateChanged
from ..graph.split import has_custom_ops, split_graph
from ..graph.tokens import (is_token_tensor, output_values, placeholder_values, refuse_other_token_dims,
                            token_dims)
from ..graph.writes import inputs_sharing_memory, writes_to_inputs


class GraphRunner:
    """What the Dynamo backend returns for one traced graph: the split graph with runners in place."""

    def __init__(
        self,
        graph: torch.fx.GraphModule,
        state: CaptureState,
        compiler: SharedCompiles,
        splitting_ops: frozenset[str],
        eager_writes: dict[torch.fx.Node, str] | None = None,
        after_break: bool = False,
        sizes: list[int] = (),
    ):
        self.state = state
        self.after_break = after_break
        self.graphs_allowed = state.graphs_enabled and not state.capture_done
        placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
        written = {placeholder for _, placeholder in writes_to_inputs(graph, placeholders)}
        written |= set(inputs_sharing_memory(placeholders, written))  # views of one cache (``unbind`` per layer)
        self.written = {i: _compat.argument_source(node) for i, node in enumerate(placeholders) if node in written}
        """Inputs the graph writes in place (a KV cache, also one inside a list or an object): never copied, since
        the write must reach the caller's tensor; the first call's tensors are the graphs' (``pinned``)."""
        self.pinned: dict[int, int] = {}
        started = time.perf_counter()
        self.eager_writes = list((eager_writes or {}).values())
        """In-place writes into static tensors cut out of the pieces (see ``checks.static_writes``)."""
        self.custom_ops = has_custom_ops(graph, splitting_ops)
        """Whether a custom op other than the splitting ops runs in the pieces (``runtime/op_reads.py``)."""
        refuse_other_token_dims(graph, splitting_ops)
        self.split_graph, partitions = split_graph(graph, splitting_ops, eager_writes)
        self.pieces: list[PieceRunner] = []
        self.splitting_ops: list[SplitOpRunner] = []
        for partition in partitions:
            if partition.splitting_op is not None:
                runner = SplitOpRunner(partition.name, partition.module, partition.splitting_op, state, list(sizes),
                                       cut=partition.splitting_op not in splitting_ops, by_shape=after_break)
                self.splitting_ops.append(runner)
            else:
                # Inductor rewrites the graph it compiles (its output becomes a list): the piece's own FX graph, which
                # runs op by op where that is needed (runtime.bounds, a capture failure's search), is a copy.
                module = partition.module
                original = module if compiler.name == "eager" else \
                    torch.fx.GraphModule(module, copy.deepcopy(module.graph))
                compiled = compiler.compile(module, placeholder_values(module))
                runner = PieceRunner(partition.name, original, compiled, state, self)
                self.pieces.append(runner)
            # A plain attribute, not a submodule: the split graph's code calls it without nn.Module overhead.
            delattr(self.split_graph, partition.name)
            self.split_graph.__dict__[partition.name] = runner
        self.compile_seconds = time.perf_counter() - started
        inputs = placeholder_values(graph)
        self.token_inputs = [is_token_tensor(v) for v in inputs]
        self.symbolic = any(self.token_inputs)
        outputs = output_values(graph)
        self.token_outputs = [(token_dims(v) or [None])[0]
                              for v in (outputs if isinstance(outputs, (tuple, list)) else [outputs])]
        self.external: list[int] | None = None  # inputs that need a static copy; decided on the first call
        self.unchecked: str | None = None
        """Why this graph may not serve padded calls: traced after the first call (the model's state changed), so
        the first call's padding checks never ran on it (``StateChanged``)."""
        self.input_buffers: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, *args):
        state = self.state
        if self.unchecked is not None and state.call.size != state.call.num_tokens:
            raise StateChanged(self.unchecked)
        if state.call.phase is not Phase.DIRECT:
            if self.external is None:
                self._take_inputs(args)
            if self.pinned:
                self._check_pinned(args)
            if self.external:
                args = self._stage_inputs(list(args))
        outputs = self.split_graph(*args)
        if self.symbolic and not self.after_break:  # with graph breaks sizes are symbolic or not: leave unknown
            flat = outputs if isinstance(outputs, (tuple, list)) else [outputs]
            for value, dim in zip(flat, self.token_outputs):
                if isinstance(value, torch.Tensor):
                    state.token_outputs[id(value)] = dim
        return outputs

    def _take_inputs(self, args: tuple) -> None:
        """At the first call: which inputs are copied into fixed buffers on every call (tensors the runtime does
        not hold fixed: made by Python between graphs, or found inside an argument), and which written ones are
        the graphs' from now on."""
        state = self.state
        self.external = []
        for i, value in enumerate(args):
            if not isinstance(value, torch.Tensor) or value.data_ptr() in state.stable_ptrs:
                continue
            if i in self.written and not self._carries_rows(i, value):
                self.pinned[i] = value.data_ptr()
                state.stable_ptrs.add(value.data_ptr())
                state.static_storages.add(value.untyped_storage().data_ptr())
            else:
                self.external.append(i)

    def _carries_rows(self, index: int, value: torch.Tensor) -> bool:
        """An activation Python handed on between graphs (after a graph break), not state: staged."""
        return self.token_inputs[index] or (self.after_break and value.dim() > 0
                                            and value.shape[0] == self.state.call.size)

    def _check_pinned(self, args: tuple) -> None:
        for i, pointer in self.pinned.items():
            if args[i].data_ptr() != pointer:
                raise ValueError(
                    f"piecewise: {self.written[i]} is written in place by the forward (a KV "
                    f"cache) and is not the tensor it was at the first call. The captured graphs write the first "
                    f"call's tensor: pass the same tensors on every call (write new contents into them), or compile "
                    f"again.")

    def _stage_inputs(self, args: list) -> list:
        """Copy inputs made by Python between graphs into fixed buffers (one per size for odd shapes)."""
        size = self.state.call.size
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
