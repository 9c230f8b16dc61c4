"""The breakable front-end: no tracing. The model's own Python runs under stream capture, per capture size; each
splitting-op call ends the current graph segment, runs eagerly on the real rows (into static buffers), and the
next segment begins. Replay runs the size's segments and recorded calls in order, with no model Python at all.

Since it traces nothing, it learns the forward by running it (``breakable_survey``): unpadded at two token counts
before anything is padded (which inputs, numbers and outputs carry the tokens, at each call site), and, while the
first call prepares, each run's ops against the run before at the same size (a Python value that changes from run
to run would be frozen) and at the next larger capture size (a path that depends on the token count). Python that
Dynamo cannot trace (a JIT library's subprocess, a lock) simply runs: its kernels are recorded.

With ``compiler="inductor"`` the forward runs through ``torch.compile`` (``breakable_regions``): each region Dynamo
traces is compiled by Inductor around its splitting ops, and the interceptor cuts at the ops the compiled code
calls. Each size then runs padded once before its capture, where Inductor's kernels compile and tune.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable
from typing import Any

import torch

from ..capture.outputs import output_tensors
from ..capture.segment import stream_capturing
from ..capture.splitcall import SplitCall
from ..capture.state import Phase
from ..errors import ForwardRefused
from ..opaque import resolve_splitting_ops
from .base import Parts, register
from .breakable_interceptor import CompiledInterceptor, Interceptor, new_split_call
from .breakable_reads import AttributeReads
from .breakable_regions import Regions, dispatch_mode_skips_compile
from .breakable_steps import Recording, note_output_dims, storage
from .breakable_survey import Observed, OpLog, Survey

logger = logging.getLogger(__name__)


@register
class BreakableFrontend:
    """Runs the model's Python per size under capture; replays the recorded segments and calls."""

    name = "breakable"
    runs_every_size = True
    """Each capture size runs the forward's Python once at the first call (on a CPU too): paths that depend on the
    token count show there."""
    replays_python = False
    """A replay runs no Python of the forward."""

    def __init__(self, parts: Parts):
        self.model = parts.model
        self.state = state = parts.state
        self.stats = parts.stats
        self.stager = parts.stager
        self.ladder = parts.ladder
        self.splitting = resolve_splitting_ops(parts.config.splitting_ops)
        self.static = state.static_storages  # the model's parameters and buffers, static arguments (late ones too)
        self.recordings: dict[int, Recording] = {}
        self.calls: dict[tuple, SplitCall] = {}
        """Call site (kind, op, occurrence) → its ``SplitCall``, shared by every size."""
        self.kinds: dict[Any, str] = {}
        self.module_storages: set[int] | None = None
        self.op_watch = None
        """While the captures run: the watch of custom ops' reads, which the interceptor runs every op through
        (``takes_op_watch``)."""
        self.survey: Survey | None = None
        self.surveying: dict[tuple, Observed] | None = None
        self.logs: dict[tuple[int, tuple[bool, bool]], OpLog] = {}
        self.runs: dict[tuple[int, tuple[bool, bool]], int] = {}
        """The last logged run at each (size, kind), while the first call prepares; a run's kind is (whether it
        captured, whether it ran whole for a full graph). Runs are compared with runs of their kind only: code that
        checks ``torch.cuda.is_current_stream_capturing()`` (transformers' masks) takes another path under capture,
        rightly, and a full graph's run calls the splitting ops inline. The full graphs' runs stand for the sizes
        they serve alone, whose piecewise graphs are not captured (``capture_sizes``)."""
        self.reads = AttributeReads(parts.model)
        self.graphs_allowed = True
        self.regions: Regions | None = None
        self.interceptor = Interceptor
        if parts.config.compiler != "eager":
            self.interceptor = CompiledInterceptor
            self.regions = Regions(parts.model, parts.config.compiler, self.splitting, parts.ladder, parts.stats,
                                   self.static, self.stager)
            # Inductor's kernels compile and tune on their first run, which cannot be captured: the regions, traced
            # once for every count, first run at the rehearsals and the padding check; a size whose capture meets a
            # first run anyway (a region traced for one token alone) is run padded and captured again
            # (``capture_sizes._capture_size``).

    def call_forward(self, arguments: dict[str, Any]) -> Any:
        """The model's forward: as written, or through its compiled regions."""
        # Patched attribute reads would break Dynamo's regions; under another dispatch mode (the index-bounds probe)
        # Dynamo would run them eagerly and mark their frames to be skipped from then on.
        try:
            if self.regions is None or self.reads.recording or dispatch_mode_skips_compile():
                return self.model(**arguments)
            return self.regions(arguments)
        except NotImplementedError as exc:
            operator = re.search(r"HigherOrderOperator (\w+)", str(exc))
            if operator is None:
                raise
            forget_frames(exc.__traceback__)  # what Dynamo marked while they ran under the interceptor's mode
            how = ("a `cond` imported by name, `from torch import cond`: call it as `torch.cond(...)`, which breakable "
                   "runs as the Python branch it stands for" if operator[1] == "cond" else
                   "it has no rule for breakable's dispatch mode: make the call a splitting op "
                   "(piecewise.opaque_op(..., split=True)), as attention is")
            raise ForwardRefused(
                f"piecewise: the forward calls the higher-order op `{operator[1]}`, which the breakable front-end "
                f"cannot run ({how}), or use CaptureConfig(frontend='dynamo'), which runs it between the captured "
                f"pieces.", "host_sync") from exc

    def splitting_ops(self) -> frozenset[str]:
        return self.splitting

    def prepare(self, rehearse: Callable[[int], Any], tokens: int) -> None:
        """Survey the forward unpadded at the first call's token count and at one less (two, for one token); the
        first run also notes the module attributes it reads (``AttributeReads``). Hooks around the compiled module
        that its compiled regions would leave out are refused first."""
        from ..runtime.hooks import top_level_hooks  # runtime imports the front-ends

        hooks = top_level_hooks(self.model) if self.regions is not None else []
        if hooks:
            raise ForwardRefused(
                f"piecewise: the compiled module has Python hooks around its call ({'; '.join(hooks[:3])}), which "
                f"the regions Inductor compiles (of its forward) would leave out. Register them on a submodule, "
                f"apply them to the runner's output, or use CaptureConfig(compiler='eager').", "module_hook")
        survey = Survey()
        for index, count in enumerate((tokens, tokens - 1) if tokens > 1 else (1, 2)):
            self.surveying = {}
            try:
                output = self.reads.record(lambda: rehearse(count)) if index == 0 else rehearse(count)
            finally:
                seen, self.surveying = self.surveying, None
            survey.observe(count, seen, output_tensors(output))
        survey.settle()
        self.survey = survey

    def run(self, arguments: dict[str, Any]) -> Any:
        """The forward on ``arguments`` for ``state.call``: plain (direct), padded, captured or replayed."""
        state = self.state
        call = state.call
        if call.phase is Phase.DIRECT:
            output = self.call_forward(arguments)
            if state.preparing or not state.graphs_enabled:  # values the forward sets itself (a counter, a mask it
                self.reads.refresh()  # keeps): those after its run. After capture, a change must reach a replay
            return output
        if call.phase is Phase.REPLAY:
            recording = self.recordings.get(call.size)
            if recording is not None:
                self.reads.check()
                output = recording.replay(state)
                state.replays += recording.graphs
                self.stats.replays += recording.graphs
                state.splitting_op_calls = len(recording.steps) - recording.graphs
                return output
        if self.logs and not state.preparing:
            self.logs.clear()
        capturing = call.phase is Phase.CAPTURE and self.graphs_allowed and state.graphs_enabled
        recording = Recording(call.size) if capturing else None
        logged = state.preparing and self.surveying is None and not call.checked
        kind = (capturing or call.full and stream_capturing(), call.full)  # a full graph captures without a recording
        log = self._log(call.size, kind) if logged else None
        # The probe of index bounds (runtime.bounds) goes outside: its own reads are not the forward's ops.
        with state.bounds if call.checked else contextlib.nullcontext(), \
                self.interceptor(self, call.num_tokens, call.size, recording, log, self.surveying) as interceptor:
            output = interceptor.forward(arguments)
        if state.preparing or not state.graphs_enabled:  # (a replay runs no Python: what the forward set stays as
            self.reads.refresh()  # the capture left it, and a change by the caller must still be seen there)
        if log is not None:
            self._judge(log, call.size, kind)
        if self.surveying is None:
            dims = self._output_dims(output)
            note_output_dims(state, output, dims)
            if recording is not None:
                recording.output, recording.output_dims, recording.keep = output, dims, self._keeps
                self.recordings[call.size] = recording
                state.captured_this_size.append(recording)
        self.stats.pieces = max(self.stats.pieces, interceptor.calls + 1)
        return output

    def split_call(self, key: tuple, func: Any, call: Any, leaves: list, spec: Any, cut: bool) -> SplitCall:
        split = self.calls.get(key)
        if split is None:
            roles = self.survey.roles.get(key) if self.survey is not None else None
            split = self.calls[key] = new_split_call(self, key, func, call, leaves, spec, cut, roles)
        return split

    def _output_dims(self, output: Any) -> list[int | None] | None:
        dims = self.survey.output_dims if self.survey is not None else None
        if dims is None or (not isinstance(output, torch.Tensor) and len(output_tensors(output)) != len(dims)):
            return None
        return dims

    # --- runs compared while the first call prepares ------------------------------------------------------

    def _log(self, size: int, kind: tuple[bool, bool]) -> OpLog:
        """This run's log, compared with the last run of its kind at the same size, unless that was the first there
        (what a forward builds on first use, a table for a token count, is built in it), and with the last at the
        next larger capture size."""
        larger = next((s for s in self.ladder.sizes if s > size), None)
        references = [(size, True)] if self.runs.get((size, kind), 0) >= 2 else []
        references.append((larger, False))
        return OpLog([(s, same, self.logs[(s, kind)]) for s, same in references if (s, kind) in self.logs])

    def _judge(self, log: OpLog, size: int, kind: tuple[bool, bool]) -> None:
        self.logs[(size, kind)] = log
        self.runs[(size, kind)] = self.runs.get((size, kind), 0) + 1
        for other, same, difference in log.finish():
            if same:
                raise ForwardRefused(
                    f"piecewise: the forward's Python gives other values on another run of the same call, at "
                    f"{difference}: a number drawn with random, read from a clock, counted in Python, or read from a "
                    f"tensor's data on the host (`.numpy()`, `.tolist()`: a count over the rows, which the pad rows "
                    f"change). A captured graph keeps the values of its capture, so every replay would repeat them.",
                    "frozen_value")
            if other - size > 1:
                raise ForwardRefused(
                    f"piecewise: the forward takes another path at {size} tokens than at {other}, at {difference}: it "
                    f"depends on the token count, and calls of {size + 1}..{other - 1} tokens, padded to {other}, "
                    f"would take the path of {other}. Move the decision out of forward (a runner per path), make the "
                    f"code that depends on the count a splitting op (piecewise.opaque_op(..., split=True)), or capture "
                    f"every count where the path changes (add {size + 1}..{other - 1} to capture_sizes).",
                    "token_branch")

    # --- the rest of the front-end interface --------------------------------------------------------------

    def _keeps(self, tensor: torch.Tensor) -> bool:
        """Whether a recorded tensor lives outside the graph pool (static, staged or a splitting call's buffer)."""
        pointer = storage(tensor)
        return pointer in self.static or pointer in self.state.buffer_storages or self.stager.owns(tensor)

    def runs_custom_ops(self) -> bool:
        return True  # the forward's Python runs at every capture: any op may

    def takes_op_watch(self, watch: Any) -> bool:
        """Every op of a capture already passes through the interceptor: it runs them through ``watch`` itself, one
        Python dispatch per op instead of two (None: the captures are over)."""
        self.op_watch = watch
        return True

    def check_state(self, arguments: dict[str, Any], full: bool) -> None:
        """Raise ``ValueError`` (``AttributeReads.check``) when an attribute the forward reads was assigned since the
        first call: graphs (full or piecewise) and padded runs would use what it held."""
        if full or not self.state.graphs_enabled:  # (piecewise replays check in ``run``)
            self.reads.check()

    def release(self) -> None:
        self.recordings.clear()
        self.graphs_allowed = False

    def graph_count(self) -> int:
        return sum(recording.graphs for recording in self.recordings.values())

    def mixing_hint(self) -> tuple[str, list]:
        return "", []


def forget_frames(traceback: Any) -> None:
    """Drop Dynamo's state for the code of every frame in ``traceback``: a higher-order op's wrapper that
    ``torch.compile`` ran under breakable's dispatch mode (``flex_attention`` in eager) was left marked, and the
    user's own eager calls of it failed from then on."""
    remove = getattr(torch._dynamo.eval_frame, "remove_from_cache", None)
    while traceback is not None and remove is not None:
        remove(traceback.tb_frame.f_code)
        traceback = traceback.tb_next
