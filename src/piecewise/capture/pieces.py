"""One compiled piece: run it, capture it as a CUDA graph per size, replay it.

Invariants that make replay correct:
- every tensor a captured piece reads lives at a fixed address: static buffers (model inputs, splitting-op
  outputs, inputs produced by Python between graph breaks), parameters, static arguments, or outputs of
  earlier pieces of the same size;
- pieces replay in capture order, so memory the shared pool reused during capture is live at replay exactly
  when it was live during capture; piece outputs are kept as non-owning aliases so sizes share the pool.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from ..errors import CaptureFailed
from .buffers import map_tensors
from .state import CaptureState, Phase


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
        call = state.call
        if call.phase is Phase.REPLAY:
            graph = self.graphs.get(call.size)
            if graph is not None:
                graph.replay()
                state.replays += 1
                return self.outputs[call.size]
        elif call.phase is Phase.CAPTURE and self.owner.graphs_allowed:
            return self._capture(args)
        return self.compiled(*args)

    def _capture(self, args: tuple) -> Any:
        size = self.state.call.size
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.state.pool)
        try:
            output = self.compiled(*args)
        except Exception as exc:
            abandon_capture(graph, self.state)
            raise self._explain_failure(exc, args) from exc
        if end_capture(graph):
            graph.replay()  # give the outputs real values: the splitting op after this piece reads them
            self.graphs[size] = graph
            self.outputs[size] = output
            self.state.captured_this_size.append(self)
        # else: the piece launched no kernel (views only); it keeps running eagerly, which costs no launch
        return output

    def release_outputs(self, size: int) -> None:
        """Swap this size's outputs for non-owning aliases so the pool can reuse them for other sizes."""
        self.outputs[size] = map_tensors(self.outputs[size], _compat.non_owning_alias)

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


_EMPTY_GRAPH = "The CUDA Graph is empty"


def end_capture(graph: torch.cuda.CUDAGraph) -> bool:
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


def abandon_capture(graph: torch.cuda.CUDAGraph | None, state: CaptureState | None) -> None:
    """End a capture that failed (``graph``; None when its ``capture_end`` already raised), and leave CUDA usable
    for what follows.

    When ``capture_end`` fails (an invalidated capture, an unjoined side stream), torch tells neither the
    allocators nor the RNG generators that capture ended. The device allocator's recording to the pool is ended
    here; the pool is retired all the same (``CaptureState.retire_pool``: the pinned-host allocator's recording
    cannot be ended from Python). Every later random draw on the device would raise "Offset increment outside
    graph capture": one empty capture on a fresh stream ends the generators' capture state."""
    ended = False
    if graph is not None:
        try:
            graph.capture_end()
            ended = True
        except Exception:  # noqa: BLE001 - the capture is already invalid; the caller reports why
            pass
    torch.cuda.synchronize()
    if not ended and state is not None and state.pool is not None:
        end_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end_pool is not None:
            try:
                end_pool(torch.cuda.current_device(), state.pool)
            except RuntimeError:  # "not currently recording": capture_end got as far as ending it
                pass
        state.retire_pool()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        reset = torch.cuda.CUDAGraph()
        try:
            reset.capture_begin()
            end_capture(reset)
        except Exception:  # noqa: BLE001 - nothing was captured: nothing to undo
            pass
    torch.cuda.synchronize()


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
            trial.capture_begin()
            try:
                if node.op == "call_method":
                    env[node] = getattr(node_args[0], node.target)(*node_args[1:], **node_kwargs)
                else:
                    env[node] = target(*node_args, **node_kwargs)
            finally:
                end_capture(trial)
        except Exception:
            abandon_capture(None, None)
            return node
    return None
