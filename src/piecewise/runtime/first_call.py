"""The first call: eager warm-up, the front-end chosen, the padding check, then every size captured.

Every run here is a rehearsal (``piecewise.context().rehearsal``): its results are discarded, and the call
then runs once more for real.
"""

from __future__ import annotations

import logging
import random
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch

from .. import _compat
from ..capture.session import capture_session
from ..capture.state import Call, Phase
from ..context import forward_context
from ..errors import BlockerKind, ForwardRefused, VerificationError
from ..frontends.breakable import BreakableFrontend
from ..frontends.dynamo import DynamoFrontend
from ..frontends.dynamo_trace import DynamoBlocked
from ..opaque import opaque_call_counts, resolve_splitting_ops
from .full_graphs import check_full_padding
from .verify import verify

if TYPE_CHECKING:
    from .model import PiecewiseModel

logger = logging.getLogger(__name__)

# What the Dynamo front-end refuses that the breakable one would get wrong the same way (padding, repeated
# first-call runs): ``frontend="auto"`` raises these instead of switching.
_REFUSED_BY_BOTH = frozenset({BlockerKind.TOKEN_MIXING, BlockerKind.STATE_UPDATE, BlockerKind.TOKEN_ARGUMENT_WRITE,
                              BlockerKind.TOKEN_BRANCH})


class _RandomState:
    """Python's and torch's generator states (CPU and every initialised CUDA device), to draw the same numbers
    again."""

    def __init__(self):
        self.python = random.getstate()
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def restore(self) -> None:
        random.setstate(self.python)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def prepare(runner: "PiecewiseModel", arguments: dict[str, Any]) -> None:
    """Warm up, choose the front-end, check padding, capture (on CUDA)."""
    runner.watch.start()
    model_tensors = [*runner.model.parameters(), *runner.model.buffers()]
    static = runner.arguments.record_first(arguments)
    runner.state.stable_ptrs.update(t.data_ptr() for t in [*model_tensors, *static])
    runner.state.static_storages.update(t.untyped_storage().data_ptr() for t in [*model_tensors, *static])
    started = time.perf_counter()
    tokens = arguments[next(iter(runner.arguments.dynamic))].shape[0]
    before = opaque_call_counts()
    with forward_context(tokens, tokens, rehearsal=True):
        runner.model(**arguments)  # eager warm-up: JIT builds and lazy op schemas happen outside tracing
    called = {name for name, count in opaque_call_counts().items() if count != before.get(name, 0)}
    runner.stats.prewarm_seconds = time.perf_counter() - started
    devices = {t.device.type for t in model_tensors} | {arguments[n].device.type for n in runner.arguments.dynamic}
    use_graphs = runner.config.cuda_graphs and "cuda" in devices and torch.cuda.is_available()
    runner.state.graphs_enabled = runner.stats.cuda_graphs = use_graphs
    device = arguments[next(iter(runner.arguments.dynamic))].device
    runner.full.resolve(called, resolve_splitting_ops(runner.config.splitting_ops), device)
    choice = runner.config.frontend
    # "auto": the first that works of Dynamo as one graph, breakable, Dynamo with graph breaks.
    if choice == "auto" and not runner.config.strict:
        candidates = [lambda: _dynamo(runner, "report"), lambda: _breakable(runner),
                      lambda: _dynamo(runner, "break")]
    elif choice == "breakable":
        candidates = [lambda: _breakable(runner)]
    else:
        candidates = [lambda: _dynamo(runner, "raise" if runner.config.strict else "break")]
    reasons: list[str] = []
    for index, make in enumerate(candidates):
        runner.frontend = make()
        runner.stats.frontend = runner.frontend.name
        runner.state.preparing = True
        try:
            check_padding(runner, arguments)  # the Dynamo front-end traces here
            dropped = _sizes_dropped_for_nothing(runner) if index < len(candidates) - 1 else None
            if dropped:
                logger.info("piecewise: %s", dropped)
                _reset(runner)
                reasons.append(dropped)
                continue
            if runner.full.sizes:
                check_full_padding(runner.full, arguments, tokens)
            if use_graphs:
                capture_all(runner, arguments)
            break
        except Exception as exc:  # noqa: BLE001 - with "auto", whatever stops a front-end is a reason to move on
            if index == len(candidates) - 1 or (isinstance(exc, ForwardRefused) and exc.kind in _REFUSED_BY_BOTH):
                raise
            reasons.append(_reset_after(runner, exc))
        finally:
            runner.state.preparing = False
    if choice == "auto" and not runner.config.strict:
        runner.stats.frontend_reason = "; ".join(reasons) or "Dynamo traced the forward as one graph with no blocker"
    if not use_graphs:
        reason = "disabled by CaptureConfig(cuda_graphs=False)" if not runner.config.cuda_graphs else "no CUDA"
        logger.info("piecewise: pieces run without CUDA graphs (%s)", reason)
    if runner.config.verify != "off":
        sizes = runner.ladder.sizes if runner.config.verify == "all" else sorted({runner.ladder.sizes[0],
                                                                                 runner.ladder.sizes[-1]})
        started = time.perf_counter()
        report = verify(runner, arguments, sizes)
        runner.stats.verify_seconds = time.perf_counter() - started
        runner.stats.verified_sizes = list(sizes)
        logger.info("piecewise: verified %d size(s) in %.2f s", len(sizes), runner.stats.verify_seconds)
        if not report.ok:
            raise VerificationError(report)


def _dynamo(runner: "PiecewiseModel", on_blocker: str) -> DynamoFrontend:
    return DynamoFrontend(runner.model, runner.config, runner.state, runner.ladder, runner.stats,
                          lambda: runner.arguments.describe_change(runner.last_arguments), on_blocker,
                          lambda: list(runner.arguments.dynamic))


def _breakable(runner: "PiecewiseModel") -> BreakableFrontend:
    return BreakableFrontend(runner.model, runner.config, runner.state, runner.stats, runner.stager)


def _reset_after(runner: "PiecewiseModel", exc: Exception) -> str:
    """``frontend="auto"``: a front-end failed; drop what it made, warn once with the reasons and the fix that
    brings it back, and return a one-line reason."""
    failed = runner.frontend.name
    if isinstance(exc, DynamoBlocked):
        reasons = [blocker.format() for blocker in exc.blockers]
        summary = f"Dynamo blocked ({len(reasons)} blocker(s))"
    else:
        inner = getattr(exc, "inner_exception", None) or exc
        reasons = [f"[{getattr(inner, 'kind', type(inner).__name__)}] {str(inner).removeprefix('piecewise: ')}"]
        summary = f"{failed} failed ({type(inner).__name__})"
    following = "the breakable front-end (CUDA graphs between splitting ops, pieces not compiled)" \
        if failed == "dynamo" else "the Dynamo front-end with graph breaks (each untraceable region runs eagerly)"
    warnings.warn(
        f"piecewise: the {failed} front-end cannot take this forward, so it runs with {following}. Fix what is "
        f"below to bring the {failed} front-end back" + (" (and compiler='inductor' fusion)" if failed == "dynamo"
                                                         else "") +
        ", or choose a front-end with CaptureConfig(frontend=...) to skip this search:\n" + "\n\n".join(reasons),
        stacklevel=6,
    )
    _reset(runner)
    return summary


def _sizes_dropped_for_nothing(runner: "PiecewiseModel") -> str | None:
    """``frontend="auto"``: why to leave a Dynamo trace that holds, or None. A trace that serves not every size
    (one-token calls padded to 2, ``Ladder.drop_one``) with pieces compiled by nothing (``compiler="eager"``) gives
    the same graphs as breakable at fewer sizes; breakable captures each size with its own Python, the trace having
    found no blocker in it."""
    if runner.frontend.name != "dynamo" or runner.config.compiler != "eager" or not runner.ladder.notes:
        return None
    return (f"breakable, which serves every size: with compiler='eager' Dynamo's trace gains nothing, and there "
            f"{runner.ladder.notes[0]}")


def _reset(runner: "PiecewiseModel") -> None:
    """Drop what the front-end in use made (graphs, pool, dropped sizes, trace counts) before the next."""
    if runner.state.pool is not None:
        torch.cuda.synchronize()
    runner.frontend.release()
    runner.full.release()
    runner.state.pool = runner.state.workspace_graph = None
    runner.state.retired_pools.clear()
    runner.state.capture_done = False
    runner.state.captured_this_size.clear()
    runner.ladder.sizes[:] = runner.config.sizes  # a size dropped for one front-end is served again
    runner.ladder.notes.clear()
    runner.stats.update(traces=0, pieces=0, eager_writes=0, graph_breaks=0, captured_sizes=[], warmed_sizes=[],
                        graphs=0)


def check_padding(runner: "PiecewiseModel", arguments: dict[str, Any]) -> None:
    """Run the first call's leading tokens padded by one row twice (after a run that traces), the padding
    rows zero and then copies of real rows. A forward whose pieces compute each row from that row alone
    (attention and other cross-token code in splitting ops) gives the same real rows both times; one that
    mixes rows (a sum or softmax over the tokens, ``x[-1]``) would return padding-dependent numbers on
    every padded call: refused here."""
    sizes = [size for size in runner.ladder.sizes if size >= 2]
    if not sizes:
        return
    size = sizes[0]
    given = runner.arguments.given_tokens(arguments)
    rows = min(arguments[given[0]].shape[0], size - 1)
    results = []
    direct_calls = runner.stats.direct_calls  # the check's calls are not the user's
    rng = _RandomState()  # both compared runs draw the same random numbers: only the padding differs
    for fill in ("trace", "zeros", "copies"):  # tracing may draw random numbers itself: a run before
        rng.restore()
        staged = runner.stager.stage(runner.arguments.leading(arguments, rows), given, rows, size)
        if fill == "copies":
            runner.stager.fill_padding_with_copies(arguments, given, rows, size)
        output = runner.run_call(Call(Phase.PADDED, size, rows), staged, rehearsal=True)
        results.append(runner.finish(output, rows, size, clone=True))
    if hasattr(runner.frontend, "tracer"):
        runner.frontend.tracer.direct_calls = direct_calls
    runner.stats.direct_calls = direct_calls
    for index, (zeros, copies) in enumerate(zip(*(torch.utils._pytree.tree_leaves(r) for r in results[1:]))):
        if not isinstance(zeros, torch.Tensor) or zeros.is_complex():
            continue
        if zeros.is_floating_point():
            difference = float((zeros.double() - copies.double()).norm() / zeros.double().norm().clamp_min(1e-30))
            tolerance = 1e-4 if zeros.dtype in (torch.float32, torch.float64) else 1e-2
        else:  # token ids, counts, masks: equal or not
            difference, tolerance = float((zeros != copies).double().mean()) if zeros.numel() else 0.0, 0.0
        if not difference <= tolerance:  # NaN included
            hint, chain = runner.frontend.mixing_hint()
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


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _meet_other_ranks() -> None:
    """Tensor parallelism: every rank starts capturing a size together, so that no rank's capture overlaps
    another's eager collectives (the all-reduce splitting ops run between its graphs)."""
    if _distributed():
        import torch.distributed as dist

        dist.barrier()


def capture_all(runner: "PiecewiseModel", arguments: dict[str, Any]) -> None:
    """Capture every size, largest first, into one pool (a second after a capture that fails to end): a padded
    run, then the capture, per size (breakable: the padded run only where it is needed, ``_capture_size``)."""
    state = runner.state
    tokens = arguments[next(iter(runner.arguments.dynamic))].shape[0]
    given = runner.arguments.given_tokens(arguments)
    started = time.perf_counter()
    sizes = [] if runner.full.mode == "full" else runner.ladder.sizes  # "full": no piecewise graph serves a call
    # Breakable runs the model's own Python at capture, so a size needs no padded run before it once the first
    # size has built what the forward builds on first use. Ranks skip nothing: a retry on one rank would leave
    # the others waiting in its collectives. Once a pool is retired, every size warms up: no third pool.
    warm_each = runner.frontend.name != "breakable" or _distributed()
    with capture_session(state, len(sizes) + len(runner.full.sizes)) as advance:
        runner.full.capture(arguments, tokens, advance)
        for index, size in enumerate(reversed(sizes)):
            _meet_other_ranks()
            rows = min(tokens, size)
            staged = runner.stager.stage(runner.arguments.leading(arguments, rows), given, rows, size)
            warm = warm_each or index == 0 or bool(state.retired_pools)
            _capture_size(runner, Call(Phase.CAPTURE, size, rows), staged, warm)
            for captured in state.captured_this_size:
                captured.release_outputs(size)
            if state.captured_this_size:
                runner.stats.captured_sizes.append(size)
            state.captured_this_size.clear()
            advance()
    state.capture_done = True
    runner.stats.captured_sizes.sort()
    runner.stats.warmed_sizes.sort()
    runner.stats.graphs = runner.frontend.graph_count()
    runner.stats.capture_seconds = time.perf_counter() - started
    runner.stats.pool_bytes = sum(_compat.graph_pool_bytes(pool) or 0 for pool in state.pools())


def _capture_size(runner: "PiecewiseModel", call: Call, staged: dict[str, Any], warm: bool) -> None:
    """Capture one size, after a padded run when ``warm``. Without one, a forward that does host work at the first
    use of a token count (a tuning sync, a table upload: illegal while capturing) fails its capture; the size is
    then run padded, which does that work, and captured again (into a fresh pool where the failure retired the
    old one), so skipping the padded run changes no outcome."""
    state = runner.state
    if not warm:
        try:
            runner.run_call(call, staged, rehearsal=True)
            return
        except Exception as exc:  # noqa: BLE001 - whatever failed is retried the way every size used to run
            logger.info("piecewise: the capture of %d tokens failed without a padded run before it (%s); running "
                        "it padded and capturing again%s", call.size, str(exc).splitlines()[0] if str(exc) else
                        type(exc).__name__, ", into a fresh pool" if state.retired_pools else "")
            state.captured_this_size.clear()
    runner.stats.warmed_sizes.append(call.size)
    runner.run_call(Call(Phase.PADDED, call.size, call.num_tokens), staged, rehearsal=True)
    runner.run_call(call, staged, rehearsal=True)
