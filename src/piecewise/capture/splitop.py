"""One splitting op of a traced graph: runs eagerly on the real rows, writes into static buffers the next
piece reads (rows past the real tokens zero, so padding cannot spread NaN)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from ..errors import FullGraphRefused
from ..graph.tokens import is_token_tensor, output_values, placeholder_values, token_dim
from ..opaque import captured_whole, op_name, opaque_op_info
from .buffers import RowBuffer
from .state import CaptureState, Phase, probe_call


class SplitOpRunner:
    """One splitting op: runs eagerly on the real rows, writes into static buffers the next piece reads."""

    def __init__(self, name: str, module: torch.fx.GraphModule, op_name: str, state: CaptureState,
                 any_dim: bool = False, by_shape: bool = False):
        self.name = name
        self.module = module
        self.op_name = op_name
        self.state = state
        self.is_cut = any_dim
        """An in-place write cut out of the pieces (not a splitting op of the model)."""
        # Splitting ops take tokens in dimension 0. An in-place write cut out of the pieces (any_dim) may take
        # them in another (a [batch, heads, tokens, dim] cache write): its inputs are cut along that dimension.
        values = placeholder_values(module)
        self.token_dims = [token_dim(v) if any_dim else (0 if is_token_tensor(v) else None) for v in values]
        self.token_inputs = [d is not None for d in self.token_dims]
        outputs = output_values(module)
        self.single_output = not isinstance(outputs, (tuple, list))
        flat = [outputs] if self.single_output else list(outputs)
        self.token_outputs = [is_token_tensor(v) for v in flat]
        self.buffers: list[torch.Tensor | None] = [None] * len(flat)
        self.row_buffers: list[RowBuffer | None] = [None] * len(flat)
        self.sliced: dict[tuple[int, int], tuple[tuple, list]] = {}
        self.call = self._direct_call(module) or module.forward
        self.by_shape = by_shape
        """Traced with graph breaks: Dynamo makes some sizes symbolic and others not (tensors Python made between
        graphs), so the token arguments and outputs are the ones as long as the call's padded size, other than
        the model's static tensors, decided per size."""
        self.dims_by_size: dict[int, list[int | None]] = {}

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
        call = state.call
        if call.phase is Phase.DIRECT:
            return self.call(*args)
        if call.full:  # inside a full graph: on the padded rows (the op reads the token mask)
            if self.is_cut or not captured_whole(self.op_name):
                raise FullGraphRefused(
                    f"{'an in-place write into a static tensor' if self.is_cut else self.op_name} is cut out of the "
                    f"pieces and cannot run inside a full graph")
            return self.call(*args)
        rows, size = call.num_tokens, call.size
        dims = self._dims(args, size) if self.by_shape else self.token_dims
        call_args = args if rows == size else self._real_rows(args, rows, size, call.phase is Phase.REPLAY, dims)
        if state.probe is not None and not self.is_cut:
            probe_call(state, call_args)
        result = self.call(*call_args)
        tokens = self.by_shape and any(d is not None for d in dims)
        if self.single_output:
            return self._stage(0, result, rows, size, args, tokens)
        return tuple(self._stage(i, value, rows, size, args, tokens) for i, value in enumerate(result))

    def _dims(self, args: tuple, size: int) -> list[int | None]:
        dims = self.dims_by_size.get(size)
        if dims is None:
            static = self.state.static_storages
            dims = self.dims_by_size[size] = [
                d if d is not None else 0 if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == size
                and a.untyped_storage().data_ptr() not in static else None
                for a, d in zip(args, self.token_dims)]
        return dims

    def _real_rows(self, args: tuple, rows: int, size: int, keep: bool, dims: list[int | None]) -> list:
        """The first ``rows`` rows of each token argument. On replay the arguments are the same tensors
        every time (piece outputs, static buffers), so the views are made once per (size, rows)."""
        cached = self.sliced.get((size, rows))
        if cached is not None and all(map(operator.is_, cached[0], args)):
            return cached[1]
        call_args = [a if d is None else a[:rows] if d == 0 else a.narrow(d, 0, rows)
                     for a, d in zip(args, dims)]
        if keep:
            self.sliced[(size, rows)] = (args, call_args)
        return call_args

    def _stage(self, index: int, value: Any, rows: int, size: int, args: tuple, by_rows: bool = False) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        token = self.token_outputs[index] or (by_rows and value.dim() > 0 and value.shape[0] == rows
                                              and not any(value is arg for arg in args))
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
