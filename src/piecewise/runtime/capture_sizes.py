"""Every capture size captured at the first call, largest first, into one pool (a second after a capture that fails
to end): a padded run before the first size's capture only (every size's with tensor parallelism), and before a
size's second try where its first failed (host work at a first use: a tuning sync, a table upload). Full graphs come first; a size whose every call their graph serves gets
no piecewise graphs (``stats["full_only_sizes"]``): they would never replay. Where the front-end's checks compare
its runs across sizes (``Frontend.runs_every_size``: breakable's ``token_branch``), the full graphs' runs are
compared among themselves, and a size they serve alone keeps its piecewise graphs where the next size has
piecewise graphs: its run is the one the next size's piecewise run is compared with. Without CUDA graphs such a
front-end runs each size once."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..capture.session import capture_session
from ..capture.state import Call, Phase
from ..errors import CaptureOutOfMemory
from .core import Core

logger = logging.getLogger(__name__)


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _meet_other_ranks() -> None:
    """Tensor parallelism: every rank starts capturing a size together, so that no rank's capture overlaps
    another's eager collectives (the all-reduce splitting ops run between its graphs)."""
    if distributed():
        import torch.distributed as dist

        dist.barrier()


def capture_all(core: Core, arguments: dict[str, Any], graphs: bool) -> None:
    """Capture every size (``graphs``), or run each once without graphs."""
    state = core.state
    tokens = core.arguments.rows(arguments)
    given = core.arguments.given_tokens(arguments)
    started = time.perf_counter()
    sizes = [] if core.full.mode == "full" else core.ladder.sizes  # "full": no piecewise graph serves a call
    # Ranks skip nothing: a retry on one rank would leave the others waiting in its collectives. Once a pool is
    # retired, every size warms up: no third pool.
    warm_each = distributed()
    if not graphs:
        for size in reversed(sizes):
            rows = min(tokens, size)
            staged = core.stager.stage(core.arguments.leading(arguments, rows), given, rows, size)
            core.run_call(Call(Phase.CAPTURE, size, rows), staged, rehearsal=True)
        return
    captured: list[int] = []
    size = core.full.sizes[-1] if core.full.sizes else 0
    with capture_session(state, len(sizes) + len(core.full.sizes)) as advance:
        try:
            core.full.capture(arguments, tokens, advance, warm_each)
            served = [size for below, size in zip([0, *sizes], sizes) if core.full.serves_every_call(size, below)]
            if core.frontend.runs_every_size:  # a size below a piecewise one keeps its piecewise run to compare with
                above = dict(zip(sizes, [*sizes[1:], None]))
                served = [size for size in served if above[size] is None or above[size] in served]
            core.stats.full_only_sizes = served
            sizes = [size for size in sizes if size not in served]  # never replayed: not captured
            for _ in served:
                advance()
            for index, size in enumerate(reversed(sizes)):
                _meet_other_ranks()
                rows = min(tokens, size)
                staged = core.stager.stage(core.arguments.leading(arguments, rows), given, rows, size)
                warm = warm_each or index == 0 or bool(state.retired_pools)
                _capture_size(core, Call(Phase.CAPTURE, size, rows), staged, warm)
                for runner in state.captured_this_size:
                    runner.release_outputs(size)
                if state.captured_this_size:
                    captured.append(size)
                state.captured_this_size.clear()
                advance()
        except torch.OutOfMemoryError as exc:
            raise out_of_memory(core, size, captured) from exc
    state.capture_done = True
    core.stats.captured_sizes = sorted(captured)
    core.stats.warmed_sizes.sort()
    core.stats.full_warmed_sizes.sort()
    core.stats.graphs = core.frontend.graph_count()
    core.stats.capture_seconds = time.perf_counter() - started
    core.stats.pool_bytes = state.pool_bytes()


def _capture_size(core: Core, call: Call, staged: dict[str, Any], warm: bool) -> None:
    """Capture one size, after a padded run when ``warm``. Without one, a forward that does host work at the first
    use of a token count (a tuning sync, a table upload: illegal while capturing) fails its capture; the size is
    then run padded, which does that work, and captured again (into a fresh pool where the failure retired the
    old one), so skipping the padded run changes no outcome."""
    state = core.state
    if not warm:
        try:
            core.run_call(call, staged, rehearsal=True)
            return
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever failed is retried the way every size used to run
            logger.info("piecewise: the capture of %d tokens failed without a padded run before it (%s); running "
                        "it padded and capturing again%s", call.size, str(exc).splitlines()[0] if str(exc) else
                        type(exc).__name__, ", into a fresh pool" if state.retired_pools else "")
            state.captured_this_size.clear()
    core.stats.warmed_sizes.append(call.size)
    core.run_call(Call(Phase.PADDED, call.size, call.num_tokens), staged, rehearsal=True)
    core.run_call(call, staged, rehearsal=True)


def out_of_memory(core: Core, size: int, captured: list[int]) -> CaptureOutOfMemory:
    """The error for running out of device memory at ``size`` tokens while the first call prepares the graphs."""
    pool = core.state.pool_bytes() / 2**20
    done = f"sizes {sorted(captured)} were captured by then" if captured else "no size was captured by then"
    return CaptureOutOfMemory(
        f"piecewise: the device ran out of memory while running the forward at {size} tokens for its graphs "
        f"({done}; the graph pool held {pool:.0f} MiB). The largest sizes take the most: lower max_tokens (now "
        f"{core.config.max_tokens}), capture fewer sizes (capture_sizes=[...]) or fewer full graphs "
        f"(max_decode_batch, graph_mode='piecewise'), or leave more memory free (a smaller KV cache, "
        f"torch.cuda.empty_cache() before the first call).")
