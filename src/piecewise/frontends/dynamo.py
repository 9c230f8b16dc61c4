"""The Dynamo front-end: one whole-model trace (token dimension symbolic), split into FX pieces at the splitting
ops; each piece compiled once (``eager`` or ``inductor``) and captured per size by the back half.

The backend refuses what padding would break (a branch on the token count, a write into a token argument, a
state update from its own value) and cuts in-place writes into static tensors out of the pieces.
"""

from __future__ import annotations

import logging
import re
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from ..capture.compilers import make_compiler
from ..capture.state import STATE_CHANGE
from ..errors import CaptureFailed, ForwardRefused, StateChanged
from ..graph.guards import token_guard_failures
from ..graph.stack import node_stack
from ..graph.split import eager_higher_order, unused_custom_ops
from ..graph.tokens import is_token_tensor, node_place, token_mixing_nodes, user_line
from ..graph.writes import accumulates, describe_write, writes_to_inputs
from ..opaque import op_name, resolve_splitting_ops
from .base import Parts, register
from .dynamo_graph import GraphRunner
from .dynamo_trace import ForwardTracer, soften, state_guard_refusal, trace_failure

logger = logging.getLogger(__name__)


@register
class DynamoFrontend:
    """Runs the forward through one Dynamo trace whose backend returns ``GraphRunner``s.

    ``on_blocker``: what Python Dynamo cannot trace does to the trace (``ForwardTracer``)."""

    name = "dynamo"
    runs_every_size = False
    """One trace serves every size: its guards say where the forward depends on the token count."""
    replays_python = True
    """Each call runs Dynamo's bytecode of the forward (its Python side effects included) around the graphs."""

    def __init__(self, parts: Parts, on_blocker: str = "break"):
        self.config = parts.config
        self.state = parts.state
        self.ladder = parts.ladder
        self.stats = parts.stats
        self.describe_change = parts.describe_change
        self.compiler = make_compiler(parts.config.compiler)
        self.graph_runners: list[GraphRunner] = []
        self.tracer = ForwardTracer(parts.model, self.backend, on_blocker)
        self.traced_in_call = False
        self.token_names = parts.token_names
        self.guard_failures = len(_compat.guard_failures(self.tracer.method))  # Dynamo's record at the last trace

    def splitting_ops(self) -> frozenset[str]:
        return resolve_splitting_ops(self.config.splitting_ops)

    def prepare(self, rehearse: Callable[[Any], Any], tokens: int) -> None:
        """Refuse hooks on the compiled module itself (the trace is of its forward, which its call wraps);
        nothing else before the padding check: its first run traces."""
        from ..runtime.hooks import top_level_hooks  # runtime imports the front-ends

        hooks = top_level_hooks(self.tracer.method.__self__)
        if hooks:
            raise ForwardRefused(
                f"piecewise: the compiled module has Python hooks around its call ({'; '.join(hooks[:3])}), which "
                f"Dynamo's trace of its forward would leave out. Register them on a submodule, apply them to the "
                f"runner's output, or use CaptureConfig(frontend='breakable') (frontend='auto' takes it).",
                "module_hook")

    def run(self, arguments: dict[str, Any]) -> Any:
        """The forward on ``arguments`` (staged for a padded call) for ``state.call``."""
        self.traced_in_call = False
        replays = self.state.replays
        if not self.tracer.first_trace_done:
            rows = self.state.call.num_tokens
            self.tracer.diagnose_kwargs = {**arguments, **{name: arguments[name][:rows] for name in self.token_names()
                                                           if arguments.get(name) is not None}}
        if self.tracer.graph_breaks:
            soften(arguments)
        try:
            output = self.tracer((), arguments)
        except StateChanged:
            self.stats.traces += self.traced_in_call  # the new trace stays (Dynamo's cache): counted
            raise
        except (*_compat.RECOMPILE_LIMIT, *_compat.TRACE_ERROR, *_compat.UNTRACEABLE, ForwardRefused) as exc:
            failure = trace_failure(exc, self.describe_change, self.state.preparing, self.tracer.method)
            if failure is None:
                raise
            raise failure from None
        if self.traced_in_call:
            self.stats.traces += 1
        self.stats.replays += self.state.replays - replays
        if self.tracer.last_direct and not self.state.preparing:
            self.stats.direct_calls += 1
        return output

    def takes_op_watch(self, watch: Any) -> bool:
        return False  # compiled pieces dispatch their ops below any front-end code

    def runs_custom_ops(self) -> bool:
        # Python between graph breaks runs at capture too; else what the traced graphs call
        return bool(self.tracer.graph_breaks) or any(runner.custom_ops for runner in self.graph_runners)

    def check_state(self, arguments: dict[str, Any], full: bool) -> None:
        """Before a full graph serves a call (its replay runs no Dynamo code): ``StateChanged`` where the model's
        state fails the guards of the first call's trace (a flag flipped since). (A piecewise call runs the guards
        itself; a trace they send it to is ``GraphRunner.unchecked``.)"""
        direct = self.tracer.direct
        if not full or direct is None or direct.broken:
            return
        frame_locals = direct.frame_locals(arguments)
        try:
            if direct.check(frame_locals):
                return
        except Exception:  # noqa: BLE001 - a torch whose guard check wants more (DirectCall turns itself off)
            return
        guard = _compat.failed_guard(direct.check, frame_locals)
        raise StateChanged("the model's state fails a guard of the first call's trace" + (
            f" (`{guard}`)" if guard else "") + ": a flag or Python value the forward reads changed since")

    def release(self) -> None:
        """Drop every captured graph; the pieces run without graphs from now on."""
        for runner in self.graph_runners:
            runner.graphs_allowed = False
            for piece in runner.pieces:
                piece.release()

    def graph_count(self) -> int:
        return sum(piece.graph_count() for runner in self.graph_runners for piece in runner.pieces)

    # --- the backend ------------------------------------------------------------------------------------

    def backend(self, graph: torch.fx.GraphModule, example_inputs: list) -> GraphRunner:
        self._check_token_guards(example_inputs)
        token_inputs = [node for node in graph.graph.nodes
                        if node.op == "placeholder" and is_token_tensor(node.meta.get("example_value"))]
        refuse_token_argument_writes(graph, token_inputs)
        _refuse_streams(graph)
        _refuse_host_values(graph)
        if self.tracer.graph_breaks:
            _refuse_mixed_values(graph, self.state)
        splitting = self.splitting_ops()
        writes = static_writes(graph, token_inputs, splitting, compiled=self.compiler.name != "eager")
        runner = GraphRunner(graph, self.state, self.compiler, splitting, writes,
                             after_break=self.tracer.graph_breaks, sizes=self.ladder.sizes)
        self.graph_runners.append(runner)
        self._on_new_graph(runner)
        return runner

    def _check_token_guards(self, example_inputs: list) -> None:
        if self.tracer.graph_breaks:
            return  # with graph breaks Dynamo keeps the shape guards and traces again where one fails
        sizes = self.ladder.sizes
        # The capture sizes, and one above the top: calls above it run through the same trace, unpadded.
        failures = token_guard_failures(example_inputs, [*sizes, sizes[-1] + 1])
        if failures and {size for _, _, size in failures} == {1} and len(sizes) > 1 and self.stats.traces == 0 \
                and not self.state.capture_done:
            # The trace assumes more than one token (a broadcasting check in indexing or copy_, DeepSeek-V3's
            # key assembly): one-token calls are padded to the next size instead, where the graph is valid.
            assumed = "; ".join(dict.fromkeys(f"`{condition}` at {where}" for condition, where, _ in failures[:3]))
            self.ladder.drop_one(f"the trace assumes more than one token ({assumed})")
            logger.info("piecewise: %s", self.ladder.notes[-1])
            return
        if failures:
            condition, where, size = failures[0]
            hint = ""
            if re.fullmatch(r"(Ne|Eq)\(\w+,1\)", condition.replace(" ", "")):
                hint = (" A check against one token usually comes from broadcasting, e.g. in `x[index] = values`: "
                        "`x.index_copy_(0, index, values)` or `x.index_put_((index,), values)` trace without it.")
            located = re.search(r"# (\S+):(\d+) in (\w+)", where)
            raise ForwardRefused(
                f"piecewise: the forward depends on the token count: it evaluates `{condition}` at {where}, "
                f"which is false for {'capture size' if size in sizes else 'calls of'} {size}"
                f"{'' if size in sizes else ' tokens (above the top of the graphs, run through the same trace)'}. "
                f"One trace serves every token count, so the forward must not branch on it: move the branch out of "
                f"forward, or make that code a splitting op (piecewise.opaque_op(..., split=True)). The breakable "
                f"front-end (which frontend='auto' tries next) serves a branch only where the capture sizes bound it "
                f"exactly, such as one path for one token and another above.{hint}",
                "token_branch",
                [traceback.FrameSummary(located[1], int(located[2]), located[3])] if located else [],
            )

    def _on_new_graph(self, runner: GraphRunner) -> None:
        self.traced_in_call = True
        self.stats.compile_seconds += runner.compile_seconds
        self.stats.pieces_shared = self.compiler.shared
        if self.state.capture_done or self.stats.traces > 0:
            if self.state.capture_done:
                runner.graphs_allowed = False
            if self.tracer.graph_breaks:
                return  # code after a graph break is traced per new shape once; the break was reported
            change = self.describe_change()
            failures = len(_compat.guard_failures(self.tracer.method))
            failed, self.guard_failures = failures > self.guard_failures, failures
            if change == STATE_CHANGE and failed and self.state.preparing:
                # a guard on the model's Python state fails between the first call's own runs (checks, warm-up,
                # captures): it would on every later call too
                raise state_guard_refusal(self.tracer.method)
            if change == STATE_CHANGE:
                guard, _ = _compat.last_guard_failure(self.tracer.method) or (None, None)
                argument = re.match(r"L\['(\w+)'\]", guard or "")
                if argument and argument[1] != "self":
                    change = f"a guard on what argument {argument[1]!r} holds failed"
                change += f": `{guard}`" if guard else ""
            if not self.state.preparing:  # a call after the first: no padding check ran on this graph
                runner.unchecked = (f"the model was traced again after the first call ({change}), and that trace's "
                                    f"padding was never checked")
                return  # the runtime warns once, naming the change, and runs such calls without padding
            warnings.warn(
                f"piecewise: the model was traced again after the first trace ({change}); the new graph runs "
                f"without CUDA graphs. Call the model with the argument types and Python values (numbers, flags, "
                f"the fields of objects passed in) it was captured with, or compile a separate runner for this "
                f"variant.",
                stacklevel=7,
            )
            return
        self.stats.pieces += len(runner.pieces)
        self.stats.eager_writes += len(runner.eager_writes)
        self.stats.graph_breaks = len(self.tracer.blockers) if self.tracer.graph_breaks else 0

    def mixing_hint(self) -> tuple[str, list[traceback.FrameSummary]]:
        """Where the traced pieces may combine token rows: a sentence naming up to five ``file:line`` places,
        and the first one's call chain."""
        nodes = [node for runner in self.graph_runners for piece in runner.pieces
                 for node in token_mixing_nodes(piece.graph_module)]
        return mixing_places(nodes)


def refuse_token_argument_writes(graph: torch.fx.GraphModule, token_inputs: list) -> None:
    """A traced in-place write into a token argument: lost, since token arguments are copied into padded buffers."""
    for writer, placeholder in writes_to_inputs(graph, token_inputs):
        what = op_name(writer.target) or f".{writer.target}()"
        raise ForwardRefused(
            f"piecewise: {what} writes in place into {_compat.argument_source(placeholder)}, which piecewise "
            f"takes for a token argument (its dimension 0 has the call's token count). Token arguments are "
            f"copied into padded buffers on every call, so the write would be lost. If it is state kept "
            f"across calls (a cache whose first dimension happens to equal the token count), compile with "
            f"dynamic={{...}} naming only the real token arguments. If it carries tokens (a pipeline stage's "
            f"hidden states), write into a copy (`x = x.clone()` first in forward) and return it.",
            "token_argument_write", node_stack(writer),
        )


_STREAM_METHODS = frozenset({"wait_stream", "wait_event", "record_event", "record", "synchronize", "query"})


def _refuse_streams(graph: torch.fx.GraphModule) -> None:
    """A trace that keeps the forward's side streams as objects (torch 2.11: ``get_external_object_by_index`` and
    their ``wait_stream`` calls) cannot be split into pieces around its splitting ops."""
    for node in graph.graph.nodes:
        external = node.op == "call_function" and "external_object" in getattr(node.target, "__name__", "")
        if external or (node.op == "call_method" and node.target in _STREAM_METHODS):
            raise ForwardRefused(
                f"piecewise: the forward works with CUDA streams (at {node_place(node)}), which this torch's Dynamo "
                f"trace keeps as objects the "
                f"graph cannot be split around.", "side_stream", node_stack(node))


_HOST_VALUE_METHODS = frozenset({"item", "tolist"})
_HOST_VALUE_OPS = frozenset({"aten::_local_scalar_dense", "aten::item"})


def _refuse_host_values(graph: torch.fx.GraphModule) -> None:
    """A traced ``.item()`` / ``.tolist()`` (torch traces them into the graph) waits for the device: illegal while a
    graph captures, and on a padded call its value comes from the padding rows too. Refused on every device, as the
    breakable front-end refuses it, so that a CPU run answers as a CUDA one. Not refused: ``.item()`` of a graph
    input on the host (Dynamo lifts a Python float into a CPU tensor and reads it back that way)."""
    for node in graph.graph.nodes:
        value = node.meta.get("example_value")
        if node.op != "placeholder" and isinstance(value, torch.Tensor) and _compat.data_dependent(value):
            raise CaptureFailed(
                f"piecewise [capture_illegal]: {node_place(node)} makes a tensor whose shape depends on tensor values "
                f"(nonzero, boolean indexing, unique): the host must wait for the device to size it, which is illegal "
                f"while a CUDA graph captures, and on a padded call the padding rows would count too. Keep shapes "
                f"static (torch.where, a mask multiply), or move the code into a splitting op "
                f"(piecewise.opaque_op(..., split=True)).", node=node)
        if (node.op == "call_method" and node.target in _HOST_VALUE_METHODS) or \
                (node.op == "call_function" and op_name(node.target) in _HOST_VALUE_OPS):
            source = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
            value = source.meta.get("example_value") if source is not None else None
            if source is not None and source.op == "placeholder" and isinstance(value, torch.Tensor) \
                    and value.device.type == "cpu":
                continue
            raise CaptureFailed(
                f"piecewise [capture_illegal]: `.{node.target}()` at {node_place(node)} waits "
                f"for the device (its result goes to the host) outside a splitting op. That is illegal while a CUDA "
                f"graph captures, and on a padded call the value would come from the padding rows too. Keep the value "
                f"on the device (torch.where, masks), compute it before forward, or move the code into a splitting op "
                f"(piecewise.opaque_op(..., split=True)), which runs on the real rows.", node=node)


def _refuse_mixed_values(graph: torch.fx.GraphModule, state) -> None:
    """Traced with graph breaks, a graph's outputs go back to Python, which may read them (``int(t)``,
    ``t.item()``, ``if t:``). One without the token dimension computed by combining token rows (``x.abs().max()``,
    ``positions.max()``) would hand Python a value of the padding rows too on every padded call."""
    size, static = state.call.size, state.static_storages

    def tokens(node: torch.fx.Node) -> bool:
        return _carries_tokens(node.meta.get("example_value"), size, static)

    derived: set[torch.fx.Node] = set()  # computed from token rows
    combined: dict[torch.fx.Node, torch.fx.Node] = {}  # such a node without the token dimension → where it went
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            if tokens(node):
                derived.add(node)
            continue
        sources = [arg for arg in node.all_input_nodes if arg in derived]
        if not sources or node.op == "output":
            continue
        derived.add(node)
        if not tokens(node):
            combined[node] = node if any(tokens(arg) for arg in sources) else \
                next((combined[arg] for arg in sources if arg in combined), node)
    output = next(node for node in reversed(graph.graph.nodes) if node.op == "output")
    for leaf in output.all_input_nodes:
        if leaf in combined and isinstance(leaf.meta.get("example_value"), torch.Tensor):
            source = combined[leaf]
            raise ForwardRefused(
                f"piecewise: {node_place(source)} combines the "
                f"token rows into a value that goes back to Python at a graph break (.item(), int(), a branch). On a "
                f"padded call it would come from the padding rows too. Make that code a splitting op "
                f"(piecewise.opaque_op(..., split=True)), which sees only the real rows, or keep the value on the "
                f"device.", "token_mixing", node_stack(source))


def _carries_tokens(value, size: int, static: set[int]) -> bool:
    """A tensor with the token dimension: symbolic, or (a graph after a break, traced for each size) as long as the
    size in any dimension ([1, T, H] activations, a [1, 1, T, T] mask)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    return any(_compat.symbolic(extent) for extent in value.shape) or (size > 1 and size in value.shape)


def mixing_places(nodes: list[torch.fx.Node]) -> tuple[str, list[traceback.FrameSummary]]:
    import linecache

    places, chain = [], []
    for node in nodes:
        where = user_line(node)
        if where and where not in places:
            places.append(where)
            chain = chain or node_stack(node)
    if not places:
        return "", []
    shown = []
    for where in places[:5]:
        path, _, line = where.rpartition(":")
        code = linecache.getline(path, int(line)).strip()
        shown.append(f"{where}" + (f" (`{code}`)" if code else ""))
    return " Candidates: " + "; ".join(shown) + ".", chain


def static_writes(graph: torch.fx.GraphModule, token_inputs: list, splitting: frozenset[str],
                  static: list | None = None, compiled: bool = True) -> dict:
    """In-place writes of traced code into static tensors (arguments, parameters, buffers) → a label each.

    Such a write runs eagerly between pieces, on the real rows: inside a piece it would also run for the
    padding rows (a KV-cache write at the padded positions would overwrite position 0). A write that reads
    what it overwrites (``+=``, ``add_``) is refused: the first call runs the model several times. ``static``:
    the inputs that are such tensors, where not every input but the token arguments is one (a region after a
    graph break also takes the activations Python passed on). ``compiled``: the pieces go to a compiler that removes
    dead code, from which custom ops called for their effect are kept out (``unused_custom_ops``)."""
    if static is None:  # the one trace: every input but the token arguments is the model's or a static argument
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
                "state_update", node_stack(writer),
            )
        eager[writer] = f"{what} into {target}" + (f" ({where})" if where else "")
    eager.update(eager_higher_order(graph))
    if compiled:  # Inductor removes dead code; eager pieces run every node as traced
        eager.update(unused_custom_ops(graph, splitting))
    if eager:
        logger.info(
            "piecewise: %d in-place write(s) into static tensors run eagerly between pieces, on the real rows "
            "only (%s); a KV-cache write inside an attention splitting op avoids the extra cut",
            len(eager), "; ".join(eager.values()),
        )
    return eager
