"""Full graphs (``CaptureConfig.graph_mode``): one CUDA graph of the whole forward per size, attention inside, for
the calls whose splitting ops are all capturable; every other call runs piecewise (or, with ``"full"``, without
graphs).

Both front-ends run the forward for a full graph the same way: padded to the size, with the capturable splitting
ops called on the padded rows (``piecewise.context().token_mask`` tells them which rows are real) instead of
between pieces; the runtime captures that whole run as one graph into the pool the piecewise graphs use.
"""

from __future__ import annotations

import bisect
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from ..capture.buffers import map_tensors
from ..capture.outputs import output_tensors
from ..capture.segment import Segment
from ..capture.state import Call, Phase
from ..context import ForwardContext, forward_context
from ..errors import BlockerKind, ForwardRefused
from ..opaque import opaque_op_info
from .model_state import same_bits, state_tensors
from .verify import rel_error, tolerance

logger = logging.getLogger(__name__)


class FullGraphs:
    """The full-graph family of one runner: which calls it serves, its graphs, the token mask they read."""

    def __init__(self, runner: Any):
        self.runner = runner
        """The runtime core it belongs to (``runtime.core.Core``)."""
        self.mode = "piecewise"
        self.top = 0  # the largest full size; the sizes are the ladder's up to it
        self._sizes: list[int] = []
        self._ladder_sizes: int = -1  # len(ladder.sizes) when _sizes was made (the ladder can drop size 1 later)
        self.ops: list = []  # OpaqueOpInfo of every splitting op the model calls
        self.graphs: dict[int, Segment] = {}
        self.outputs: dict[int, Any] = {}
        self.output_dims: dict[int, dict[int, int | None]] = {}
        """Per size, the token dimension of each captured output (by the id of ``outputs``' tensors), as the
        front-end gave it at capture: a replay runs no front-end, and ``finish`` cuts by it ([1, T, V] logits)."""
        self.mask: torch.Tensor | None = None
        self.masks: dict[int, torch.Tensor] = {}
        self.positions: torch.Tensor | None = None
        self.tentative = False
        """No splitting op: the family waits for ``settle`` (kept only for writes cut out of the pieces)."""

    @property
    def sizes(self) -> list[int]:
        """The full sizes: the ladder's up to ``top``, following it when the first trace drops size 1 (a trace
        that holds for more than one token only), which may come after ``resolve``."""
        ladder = self.runner.ladder.sizes
        if len(ladder) != self._ladder_sizes:
            self._sizes = [size for size in ladder if size <= self.top]
            self._ladder_sizes = len(ladder)
            if self.mode != "piecewise":
                self.runner.stats.full_sizes = list(self._sizes)
        return self._sizes

    # --- first call ------------------------------------------------------------------------------------------

    def resolve(self, called: set[str], splitting: frozenset[str], device: torch.device) -> None:
        """Choose the graph mode from the splitting ops the warm-up called (``called``, opaque ops) and the
        configured ones (``splitting``: a configured op that is not an opaque op is never capturable)."""
        config, stats = self.runner.config, self.runner.stats
        infos = [opaque_op_info(name) for name in sorted(called & splitting)]
        unknown = sorted(name for name in splitting if opaque_op_info(name) is None)
        blocking = [info.name for info in infos if info.capturable is False] + unknown
        capturable = [info for info in infos if info.capturable is not False]
        wanted = config.graph_mode
        self.tentative = wanted is None and not capturable and not blocking
        if wanted is None:
            wanted = "piecewise" if blocking else "full_and_piecewise"
            stats.graph_mode_reason = (
                f"splitting ops that cannot run inside a graph: {', '.join(blocking)}" if blocking else
                "every splitting op the model calls is capturable" if capturable else
                "no splitting op: full graphs only where the forward's writes into static tensors are cut out")
        elif wanted != "piecewise" and blocking:
            raise ValueError(
                f"CaptureConfig(graph_mode={wanted!r}) needs every splitting op to be capturable, but "
                f"{', '.join(blocking)} {'is' if len(blocking) == 1 else 'are'} not: declare "
                f"opaque_op(..., capturable=...) where the op runs correctly inside a CUDA graph, or use "
                f"graph_mode='piecewise'")
        self.mode = stats.graph_mode = wanted
        if wanted == "piecewise":
            return
        self.ops = capturable
        self.top = config.max_tokens if wanted == "full" else (config.max_decode_batch or min(config.max_tokens, 256))
        self._ladder_sizes = -1
        self.mask = torch.zeros(config.max_tokens, dtype=torch.bool, device=device)
        self.positions = torch.arange(config.max_tokens, device=device)
        # refilled before every replay: the forward may read the mask (``context().token_mask``) anywhere
        self.runner.state.buffer_storages.update(t.untyped_storage().data_ptr() for t in (self.mask, self.positions))
        self.masks = {size: self.mask[:size] for size in self.sizes}

    def settle(self, graph_breaks: bool) -> None:
        """After the first trace and padded runs: writes into static tensors cut out of the pieces
        (``CaptureState.cut_runs``) make the family exact (each full graph holds them and serves only calls of
        its size: no pad row to write); without a splitting op, full graphs are kept only for such writes (with
        none the one piece is the whole forward) and not across Dynamo's graph breaks (Python between graphs)."""
        state, stats = self.runner.state, self.runner.stats
        tentative, self.tentative = self.tentative, False
        if self.mode == "piecewise":
            return
        if state.host_branch:
            self.refuse(f"{state.host_branch} takes a branch on the host at every call: no graph can hold it")
            return
        if tentative and (not state.cut_runs or graph_breaks):
            self.refuse("no splitting op" + (" and graph breaks" if state.cut_runs else ", no write cut out: the "
                                             "pieces are the whole forward"), warn=False)
            return
        if state.cut_runs:
            state.full_exact = True
            stats.graph_mode_reason = ("no splitting op" if tentative else stats.graph_mode_reason) + (
                "; writes into static tensors are cut out of the pieces: each full graph holds them and serves "
                "only calls of exactly its size (no pad row to write), other calls run piecewise")

    def refuse(self, reason: str, warn: bool = True) -> None:
        """Turn the family off (every call runs piecewise), with one warning saying why."""
        if warn:
            warnings.warn(f"piecewise: full graphs are off for this model ({reason}); calls run piecewise",
                          stacklevel=4)
        self.mode = self.runner.stats.graph_mode = "piecewise"
        self.runner.stats.graph_mode_reason = reason
        self.runner.stats.full_sizes = []
        self.top, self._sizes, self._ladder_sizes, self.graphs, self.outputs, self.output_dims = 0, [], -1, {}, {}, {}

    # --- per call --------------------------------------------------------------------------------------------

    def bucket(self, tokens: int) -> int | None:
        """The full-graph size serving a call of ``tokens``, or None (piecewise, or without graphs)."""
        if not self.sizes or tokens > self.sizes[-1]:
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, tokens)]
        if size != tokens and self.runner.state.full_exact:
            return None
        ctx = ForwardContext(tokens, size, token_mask=self.masks[size])
        return size if all(info.captures(ctx) for info in self.ops) else None

    def serves_every_call(self, size: int, below: int) -> bool:
        """Whether every call padded to ``size`` (``below`` + 1 to ``size`` tokens) replays this family's graph
        of that size: the piecewise graphs of that size would never replay. (The ops' ``capturable`` is a
        function of the call's context alone, as ``bucket`` asks it.)"""
        return size in self.graphs and all(self.bucket(tokens) == size for tokens in range(below + 1, size + 1))

    def run(self, arguments: dict[str, Any], tokens: int, size: int, rehearsal: bool = False) -> Any:
        runner = self.runner
        staged = runner.stager.stage(arguments, runner.arguments.given_tokens(arguments), tokens, size)
        torch.lt(self.positions[:size], tokens, out=self.masks[size])
        graph = self.graphs.get(size)
        if not rehearsal:
            runner.frontend.check_state(staged, full=True)
        if graph is not None:
            runner.state.token_outputs.clear()
            runner.state.token_outputs.update(self.output_dims[size])
            graph.replay()
            runner.stats.full_replays += 1
            runner.stats.replays += 1
            return self.outputs[size]
        return runner.run_call(Call(Phase.PADDED, size, tokens, full=True), staged, rehearsal=rehearsal,
                               token_mask=self.masks[size])

    # --- capture ---------------------------------------------------------------------------------------------

    def capture(self, arguments: dict[str, Any], tokens: int, advance: Callable[[], None],
                warm_each: bool) -> None:
        """Capture every full size, largest first, into the runner's pool (inside its capture session), each after
        a padded run outside the graph where ``warm_each`` (else the first size only, and a size whose capture
        failed without one: it runs padded and captures again, as piecewise sizes do). A forward that cannot be
        captured whole turns the family off, with the reason."""
        runner, state = self.runner, self.runner.state
        for index, size in enumerate(reversed(self.sizes)):
            rows = min(tokens, size)
            arguments = runner.arguments.leading(arguments, rows)
            warm = warm_each or index == 0 or bool(state.retired_pools)
            try:
                try:
                    segment, output = self._capture_size(arguments, rows, size, warm)
                except Exception as exc:  # noqa: BLE001 - retried after a padded run, as ever
                    if warm or isinstance(exc, torch.OutOfMemoryError) or _compared(exc):
                        raise
                    logger.info("piecewise: the full graph of %d tokens failed without a padded run before it (%s); "
                                "running it padded and capturing again", size,
                                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                    segment, output = self._capture_size(arguments, rows, size, warm=True)
            except Exception as exc:  # noqa: BLE001 - whatever stops a whole-forward capture turns the family off
                if isinstance(exc, torch.OutOfMemoryError) or _compared(exc):
                    raise
                self.refuse(f"the forward cannot be captured whole at {size} tokens: {exc}")
                return
            segment.replay()
            self.graphs[size] = segment
            dims, kept = state.token_outputs, {}

            def keep(tensor: torch.Tensor, dims=dims, kept=kept) -> torch.Tensor:
                alias = _compat.non_owning_alias(tensor)
                if id(tensor) in dims:
                    kept[id(alias)] = dims[id(tensor)]
                return alias

            self.outputs[size] = map_tensors(output, keep)
            self.output_dims[size] = kept
            advance()
        runner.stats.full_graphs = len(self.graphs)

    def _capture_size(self, arguments: dict[str, Any], rows: int, size: int, warm: bool) -> tuple[Segment, Any]:
        """(the graph, its output) of one full size, after a padded run outside the graph where ``warm``; a
        failed capture is abandoned before the error goes on."""
        runner = self.runner
        segment = Segment(runner.state)
        if warm:
            runner.stats.full_warmed_sizes.append(size)
        try:
            for warm_up in (True, False) if warm else (False,):
                staged, real = self._stage(arguments, rows, size)
                if not warm_up:
                    segment.begin()
                output = runner.run_call(Call(Phase.PADDED, size, real, full=True), staged, rehearsal=True,
                                         token_mask=self.masks[size])
            segment.end()  # on failure it has abandoned the capture itself
        except BaseException:
            segment.abandon()
            raise
        return segment, output

    def _stage(self, arguments: dict[str, Any], rows: int, size: int) -> tuple[dict[str, Any], int]:
        """The first call's ``rows`` staged at ``size``, and the real rows of the run: for an exact family all
        ``size`` of them, the pad rows copies of the real ones (written where the real ones were)."""
        runner = self.runner
        given = runner.arguments.given_tokens(arguments)
        staged = runner.stager.stage(arguments, given, rows, size)
        if rows < size and runner.state.full_exact:
            runner.stager.fill_padding_with_copies(arguments, given, rows, size)
            rows = size
        torch.lt(self.positions[:size], rows, out=self.masks[size])
        return staged, rows

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.output_dims.clear()
        self.runner.stats.full_graphs = 0


def _compared(exc: Exception) -> bool:
    """Whether a full graph's run (its capture, or the padding check's padded run) was refused by breakable's checks
    of its runs (``frozen_value``: a value differs between runs or is read from outside; ``token_branch``): the
    forward's Python, not the whole-forward capture, is at fault, and its piecewise graphs would be refused as
    well. Raised as it is, not turned into "full graphs are off"."""
    return isinstance(exc, ForwardRefused) and exc.kind in (BlockerKind.FROZEN_VALUE, BlockerKind.TOKEN_BRANCH)


def check_full_padding(full: FullGraphs, arguments: dict[str, Any], tokens: int) -> None:
    """The padded rows of a full-graph call must not change the real ones: compare a call padded to the next full
    size with the unpadded call (the model's splitting ops run on the padded rows with the token mask). The
    unpadded call runs first, so that pad rows writing state the real rows then read (a KV cache row) show in the
    outputs; the static tensors (arguments and the model's buffers) are put back as they were before the padded
    call, so that a careless op's pad rows leave nothing behind (where a copy of them fits in memory)."""
    runner = full.runner
    size = next((s for s in full.sizes if s > tokens and full.bucket(s) == s), None)
    if size is None or runner.state.full_exact:  # an exact family never runs a padded call
        return
    exact = _unpadded(full, arguments, tokens)
    saved = snapshot(runner, arguments)
    try:
        padded = full.run(arguments, tokens, size, rehearsal=True)
        padded = runner.finish(padded, tokens, size, clone=True)  # each output cut along its own token dimension
    except Exception as exc:  # noqa: BLE001 - an op refusing the padded rows (FullGraphRefused, its own check)
        if _compared(exc):
            raise
        full.refuse(f"the forward padded from {tokens} to {size} tokens for a full graph fails: {exc}")
        return
    finally:
        restore(saved)
    for got, want in zip(output_tensors(padded), output_tensors(exact)):
        if rel_error(got, want) > tolerance(want.dtype):
            full.refuse(f"the padded rows of a {size}-token full graph change the real rows of a {tokens}-token "
                        f"call: a capturable splitting op does not honour piecewise.context().token_mask")
            return


def snapshot(runner: Any, arguments: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor, str]] | None:
    """Copies of the state a call could write (the static tensor arguments and ``model_state``), each with its name, to put back with ``restore`` after calls made up by piecewise; None
    where the copies would not fit (``_copy_fits``)."""
    state = state_tensors(runner, arguments)
    return [(t, t.clone(), name) for name, t in state] if _copy_fits([t for _, t in state]) else None


def restore(saved: list[tuple[torch.Tensor, torch.Tensor, str]] | None) -> None:
    """Put back what ``snapshot`` copied, where a run changed it: a tensor no run wrote keeps its count of in-place
    writes (``model_state.Written`` tells by it what every run writes from what the warm-up built once)."""
    for tensor, copy, _ in saved or ():
        if not same_bits(tensor, copy):
            tensor.copy_(copy)


def _copy_fits(tensors: list[torch.Tensor]) -> bool:
    """Whether copies of ``tensors`` fit beside what the padded call needs: on CUDA, a quarter of the free memory."""
    needed = sum(t.numel() * t.element_size() for t in tensors)
    devices = {t.device for t in tensors if t.is_cuda}
    return all(needed <= torch.cuda.mem_get_info(device)[0] // 4 for device in devices)


def _unpadded(full: FullGraphs, arguments: dict[str, Any], tokens: int) -> Any:
    """What the padded call's real rows must equal: with eager pieces, the model's own forward on the real rows;
    with compiled pieces, the same pieces run as a full call on the real rows alone, unpadded (the model's forward
    would differ from them by the compiler's rounding, bf16 Inductor pieces by more than
    the tolerance, which is not what the padding check asks about: ``verify()`` compares the pieces with eager).
    Breakable's Inductor regions, a count below the ladder's first size, or an op that refuses the count inline:
    the eager forward."""
    runner = full.runner
    if runner.config.compiler != "eager" and runner.frontend.name == "dynamo" and tokens >= runner.ladder.sizes[0]:
        staged = runner.stager.stage(arguments, runner.arguments.given_tokens(arguments), tokens, tokens)
        mask = torch.ones(tokens, dtype=torch.bool, device=full.mask.device)
        try:
            output = runner.run_call(Call(Phase.PADDED, tokens, tokens, full=True), staged, rehearsal=True,
                                     token_mask=mask)
            return map_tensors(output, lambda t: t.clone())
        except Exception:  # noqa: BLE001 - an op that refuses this count inline (FullGraphRefused): eager, then
            pass
    with forward_context(tokens, tokens, rehearsal=True):
        return runner.model(**arguments)
