"""One compiled piece of a traced graph: run it, capture it as a graph segment per size, replay it.

Invariants that make replay correct:
- every tensor a captured piece reads lives at a fixed address: static buffers (model inputs, splitting-op
  outputs, inputs produced by Python between graph breaks), parameters, static arguments, or outputs of
  earlier pieces of the same size;
- pieces replay in capture order, so memory the shared pool reused during capture is live at replay exactly
  when it was live during capture; piece outputs are kept as non-owning aliases so sizes share the pool;
- a Python number among a piece's inputs (a value read in Python between graph breaks, a random draw) is baked
  into its graph: a call that passes another runs the piece without the graph, writing where the graph writes.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from ..errors import CaptureFailed
from .bounds import run_checked
from .buffers import map_tensors
from .segment import Segment, abandon_capture, end_capture
from .state import CaptureState, Phase

logger = logging.getLogger(__name__)


class PieceRunner:
    """One compiled piece: runs it, captures it per size, replays it."""

    def __init__(self, name: str, graph: torch.fx.GraphModule, compiled: Callable, state: CaptureState, owner):
        self.name = name
        self.graph_module = graph
        self.compiled = compiled
        self.state = state
        self.owner = owner
        self.segments: dict[int, Segment] = {}
        self.outputs: dict[int, Any] = {}
        self.scalars: dict[int, tuple] = {}
        """Per size, the Python numbers among the inputs at capture (empty tuple: none)."""
        self.warned = False

    def __call__(self, *args):
        state = self.state
        call = state.call
        if call.phase is Phase.REPLAY:
            segment = self.segments.get(call.size)
            if segment is not None:
                captured = self.scalars[call.size]
                if captured and _scalars(args) != captured:
                    return self._run_in_place(args, call.size)
                segment.replay()
                state.replays += 1
                return self.outputs[call.size]
        elif call.phase is Phase.CAPTURE and self.owner.graphs_allowed:
            return self._capture(args)
        elif call.checked:
            return run_checked(self.graph_module, args, self.state.bounds)
        return self.compiled(*args)

    def _capture(self, args: tuple) -> Any:
        size = self.state.call.size
        segment = Segment(self.state)
        segment.begin()
        try:
            output = self.compiled(*args)
        except torch.OutOfMemoryError:
            segment.abandon()
            raise
        except Exception as exc:
            segment.abandon()
            raise self._explain_failure(exc, args) from exc
        try:
            recorded = segment.end()
        except RuntimeError as exc:
            raise CaptureFailed(
                f"piecewise [capture_illegal]: {self.name} cannot be captured as a CUDA graph: {exc}. A side stream "
                f"forked in it and not joined, or work that waits for the host, keeps its capture from ending."
            ) from exc
        if recorded:
            segment.replay()  # give the outputs real values: the splitting op after this piece reads them
            self.segments[size] = segment
            self.outputs[size] = output
            self.scalars[size] = _scalars(args)
            self.state.captured_this_size.append(self)
        # else: the piece launched no kernel (views only); it keeps running eagerly, which costs no launch
        return output

    def _run_in_place(self, args: tuple, size: int) -> Any:
        """The piece without its graph (a Python number among its inputs differs from the capture's), its outputs
        copied to where the graph writes them: the graphs after it read them there."""
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"piecewise: {self.name} takes Python numbers ({_scalars(args)} now, {self.scalars[size]} at its "
                f"capture): a value read in Python between graph breaks, or drawn at random. Its graph would replay "
                f"the capture's, so calls with other values run this piece without it. Compute the value on the "
                f"device (a tensor), or inside a splitting op.", stacklevel=2)
        output = self.compiled(*args)
        for target, value in zip(torch.utils._pytree.tree_leaves(self.outputs[size]),
                                 torch.utils._pytree.tree_leaves(output)):
            if isinstance(target, torch.Tensor):
                target.copy_(value)
        return self.outputs[size]

    def release_outputs(self, size: int) -> None:
        """Swap this size's outputs for non-owning aliases so the pool can reuse them for other sizes."""
        self.outputs[size] = map_tensors(self.outputs[size], _compat.non_owning_alias)

    def release(self) -> None:
        self.segments.clear()
        self.outputs.clear()

    def graph_count(self) -> int:
        return len(self.segments)

    def _explain_failure(self, exc: Exception, args: tuple) -> CaptureFailed:
        node = find_capture_illegal_node(self.graph_module, args)
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
            node=node,
        )


def _scalars(args: tuple) -> tuple:
    """The Python numbers among a piece's inputs, in order, and the values of its host tensors (Dynamo passes a
    Python float it lifted as a CPU tensor; a graph on the device keeps what it read of it at capture)."""
    return tuple(a if isinstance(a, (int, float, bool)) else tuple(a.reshape(-1).tolist()) for a in args
                 if isinstance(a, (int, float, bool)) or (isinstance(a, torch.Tensor) and a.device.type == "cpu"))


def find_capture_illegal_node(graph: torch.fx.GraphModule, args: tuple) -> torch.fx.Node | None:
    """Run ``graph`` node by node, each node under its own trial capture (in a pool of its own: a failed one is
    never captured into again, ``abandon_capture``); return the first that fails."""
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
            trial.capture_begin(capture_error_mode="thread_local")
            try:
                if node.op == "call_method":
                    env[node] = getattr(node_args[0], node.target)(*node_args[1:], **node_kwargs)
                else:
                    env[node] = target(*node_args, **node_kwargs)
            finally:
                end_capture(trial)
        except torch.OutOfMemoryError:
            abandon_capture(None, None)
            raise
        except Exception:
            abandon_capture(None, None)
            return node
    return None
