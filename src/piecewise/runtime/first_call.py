"""The first call: eager warm-up, the front-end chosen, its survey, the padding checks, then every size captured.

Every run here is a rehearsal (``piecewise.context().rehearsal``): its results are discarded, and the call then
runs once more for real. The model's Python attributes are put back if the first call is refused.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture.buffers import direct_tokens
from ..capture.outputs import walk_tensors
from ..capture.state import Call, Phase
from ..context import forward_context
from ..errors import BlockerKind, CaptureFailed, CaptureOutOfMemory, ForwardRefused, VerificationError
from ..frontends import make_frontend
from ..frontends.dynamo_trace import DynamoBlocked
from ..opaque import check_fakes, opaque_call_counts, resolve_splitting_ops
from .bounds import drop_sizes_out_of_range, refuse_indices_past_rows
from .capture_sizes import capture_all, out_of_memory
from .checks import ModuleState, check_one_token, check_padding, refuse_if_rows_refused, warn_changed_state
from .rerun import refuse_if_not_repeatable
from .random_state import OWN_GENERATORS, RandomState, own_generators, refuse_cuda_generators
from . import op_reads
from .core import Core
from .count_check import check_count
from .full_graphs import check_full_padding
from .model_state import Written, model_state
from .hooks import refuse_positional_pre_hooks, warn_of_forward_hooks
from .outputs import refuse_made_tensors_in_objects, warn_of_kept_tensors
from .verify import verify

logger = logging.getLogger(__name__)

# What every front-end would get wrong the same way (padding, repeated first-call runs): ``frontend="auto"`` raises
# these instead of moving on. A branch on the token count is final once a front-end that sees the forward at every
# size found it (it took the count into account where the ladder allows). Python state that changes between runs is
# each front-end's to judge: Dynamo retraces on it (``state_guard``); breakable refuses it where a graph would keep
# its value (``frozen_value``: an op's argument, a module attribute); Dynamo with graph breaks runs a piece that
# takes such a value without its graph when it differs.
_REFUSED_BY_BOTH = frozenset({BlockerKind.TOKEN_MIXING, BlockerKind.STATE_UPDATE, BlockerKind.TOKEN_ARGUMENT_WRITE,
                              BlockerKind.TOKEN_LAYOUT})


@dataclass(frozen=True)
class Candidate:
    """One front-end ``frontend="auto"`` may take, in order."""

    name: str
    options: dict = field(default_factory=dict)
    description: str = ""
    """What the forward runs with when this candidate takes it (for the warning of the one before)."""
    compiles: bool = False
    """Whether its pieces can be compiled (what is lost when it cannot take the forward)."""


_BREAKABLE = Candidate("breakable", {}, "the breakable front-end (CUDA graphs between splitting ops, pieces not "
                                        "compiled)")
_AUTO = (Candidate("dynamo", {"on_blocker": "report"}, "the Dynamo front-end (one trace of the whole forward)",
                   compiles=True), _BREAKABLE,
         Candidate("dynamo", {"on_blocker": "break"}, "the Dynamo front-end with graph breaks (each untraceable "
                                                      "region runs eagerly)", compiles=True))


_BREAKABLE_REGIONS = Candidate("breakable", {}, "the breakable front-end with Inductor regions (CUDA graphs between "
                                                "splitting ops; the code between Dynamo's graph breaks compiled, the "
                                                "rest run as written)", compiles=True)


def _candidates(core: Core) -> tuple[Candidate, ...]:
    choice, strict = core.config.frontend, core.config.strict
    if choice == "auto" and not strict:
        if core.config.compiler != "eager":  # breakable keeps the fusion: it compiles the regions Dynamo traces
            return (_AUTO[0], _BREAKABLE_REGIONS, _AUTO[2])
        return _AUTO
    if choice == "auto":
        return (Candidate("dynamo", {"on_blocker": "raise"}),)
    options = {"on_blocker": "raise" if strict else "break"} if choice == "dynamo" else {}
    return (Candidate(choice, options),)


def prepare(core: Core, arguments: dict[str, Any]) -> None:
    """Warm up, choose the front-end, check padding, capture (on CUDA); on a refusal put the model's Python
    attributes back as they were. The random generators are put back either way: the call then draws what an
    eager call would have."""
    OWN_GENERATORS[:] = own_generators(core.model, arguments)  # the caller's own, put back with the others
    before, generators, written = ModuleState(core.model), RandomState(), Written()
    try:
        _prepare(core, arguments, before, written)
        added = written.put_back()  # what the rehearsals added to state: the call then adds once
        if added:
            logger.info("piecewise: put back %s, which every run of the forward writes", ", ".join(added))
    except ForwardRefused as exc:
        grown = before.changed()  # attributes the runs after the warm-up set (a cache grown with torch.cat)
        before.restore()
        written.put_back(everything=True)
        note = core.arguments.lead_note()  # a refusal of the count's use may come from the wrong dimension taken
        if exc.kind in (BlockerKind.TOKEN_BRANCH, BlockerKind.TOKEN_LAYOUT) and note:
            exc.args = (str(exc) + note, *exc.args[1:])
        if grown:
            exc.args = (f"{exc} The first call's runs also set the model's Python attributes {', '.join(grown[:4])} "
                        f"each time: the first call runs the forward several times, and replays run no Python, so "
                        f"state kept that way (a cache grown with torch.cat) differs from one eager call's; keep it "
                        f"in a preallocated tensor written in place, or pass it as an argument.", *exc.args[1:])
        raise
    except BaseException:
        before.restore()
        written.put_back(everything=True)
        raise
    finally:
        generators.restore()
        OWN_GENERATORS.clear()


class _Clock:
    """Adds the seconds since the last lap to a phase of ``stats.first_call_seconds``."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds, self.last = seconds, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now


def _prepare(core: Core, arguments: dict[str, Any], module_state: ModuleState, written: Written) -> None:
    core.watch.start()
    began = time.perf_counter()
    core.stats.first_call_seconds = {}
    clock = _Clock(core.stats.first_call_seconds)
    model_tensors = [*core.model.parameters(), *core.model.buffers()]
    static = core.arguments.record_first(arguments)
    core.state.stable_ptrs.update(t.data_ptr() for t in [*model_tensors, *static])
    core.state.static_storages.update(t.untyped_storage().data_ptr() for t in [*model_tensors, *static])
    # Tensors inside the other arguments (vLLM's kv_caches list, SGLang's forward_batch) are state too: breakable
    # cuts its writes into them out of the graphs (Dynamo holds the written ones fixed, ``GraphRunner``).
    core.state.static_storages.update(t.untyped_storage().data_ptr() for name, value in arguments.items()
                                      if value is not None and not isinstance(value, torch.Tensor)
                                      and name not in core.arguments.dynamic
                                      for _, t in walk_tensors(value) if t is not None)
    # So are tensors the modules hold as plain attributes (an SSM state in `self.mgr.state`, vLLM's kv_cache list).
    core.state.static_storages.update(t.untyped_storage().data_ptr() for _, t in model_state(core, arguments))
    started = time.perf_counter()
    tokens = core.arguments.rows(arguments)
    refuse_positional_pre_hooks(core.model)
    counts = opaque_call_counts()
    written.take(core, arguments)
    with forward_context(tokens, tokens, rehearsal=True):
        output = core.model(**arguments)  # eager warm-up: JIT builds and lazy op schemas happen outside tracing
    written.warmed_up()
    refuse_made_tensors_in_objects(output, [*model_tensors, *static], arguments)
    warn_of_forward_hooks(core.model)
    called = {name for name, count in opaque_call_counts().items() if count != counts.get(name, 0)}
    check_fakes(called, strides=core.config.compiler == "inductor")  # before Dynamo traces with them
    module_state.changed()  # what the warm-up built on first use is the model's from now on
    core.stats.prewarm_seconds = time.perf_counter() - started
    given = core.arguments.given_tokens(arguments)
    devices = {t.device.type for t in model_tensors} | {arguments[name].device.type for name in given}
    use_graphs = core.config.cuda_graphs and "cuda" in devices and torch.cuda.is_available()
    core.state.graphs_enabled = core.stats.cuda_graphs = use_graphs
    if use_graphs:
        refuse_cuda_generators(core.model, arguments)
    device = arguments[given[0]].device
    core.full.resolve(called, resolve_splitting_ops(core.config.splitting_ops), device)
    refuse_indices_past_rows(core, arguments)  # before any run on fewer rows than the call's
    candidates = _candidates(core)
    clock.lap("warm-up")
    store, key, described, recorded = _open_cache(core)
    clock.lap("cache")
    if recorded is not None:
        candidates = (recorded, *(c for c in candidates if c != recorded))  # the others if it fails now
    reasons: list[str] = []
    refusals: list[tuple[str, Exception]] = []
    taken = candidates[0]
    for index, candidate in enumerate(candidates):
        core.frontend = make_frontend(candidate.name, core.parts(), **candidate.options)
        core.stats.frontend = core.frontend.name
        core.state.preparing = True
        last = index == len(candidates) - 1
        try:
            core.frontend.prepare(lambda count: _rehearse(core, arguments, count), tokens)
            clock.lap("front-end")
            check_padding(core, arguments)  # the Dynamo front-end traces here
            if not core.frontend.runs_every_size:  # breakable: after its captures, which tell a branch on the count
                check_count(core, arguments)
            changed = module_state.changed()
            clock.lap("padding check")
            check_one_token(core, arguments)
            clock.lap("one-token check")
            # (Not the cache's candidate: the search that recorded it moved on from here and came back.)
            if core.ladder.notes and core.config.compiler == "eager" and not last and candidate is not recorded:
                reasons.append(f"breakable, which serves every size: with compiler='eager' Dynamo's trace gains "
                               f"nothing, and there {core.ladder.notes[0]}")
                logger.info("piecewise: %s", reasons[-1])
                _reset(core)
                continue
            try:
                drop_sizes_out_of_range(core, arguments)
            except torch.OutOfMemoryError as exc:
                raise out_of_memory(core, core.ladder.sizes[-1], []) from exc
            core.full.settle(graph_breaks=bool(core.stats.graph_breaks))
            clock.lap("sizes")
            if core.full.sizes:
                check_full_padding(core.full, arguments, tokens)
                clock.lap("full-graph check")
            if use_graphs or core.frontend.runs_every_size:
                # what custom ops read that their graphs keep (``op_reads``)
                watch = op_reads.watching(core.model, resolve_splitting_ops(core.config.splitting_ops)) \
                    if use_graphs and core.frontend.runs_custom_ops() else None
                folded = watch is not None and core.frontend.takes_op_watch(watch)
                try:
                    with watch if watch is not None and not folded else contextlib.nullcontext():
                        capture_all(core, arguments, graphs=use_graphs)
                finally:
                    if folded:
                        core.frontend.takes_op_watch(None)
                core.state.outside_reads = op_reads.settle(watch) if watch is not None else []
                core.stats.outside_reads = [str(read) for read in core.state.outside_reads]
                clock.lap("capture")
            if core.frontend.runs_every_size:
                check_count(core, arguments)
                clock.lap("count check")
            if not core.frontend.replays_python:
                warn_changed_state(changed)
            else:
                warn_of_kept_tensors(core.model, module_state.places, core.ladder.bucket(tokens) or tokens)
            taken = candidate
            break
        except Exception as exc:  # noqa: BLE001 - with "auto", whatever stops a front-end is a reason to move on
            final = _REFUSED_BY_BOTH | ({BlockerKind.TOKEN_BRANCH} if core.frontend.runs_every_size else set())
            if isinstance(exc, CaptureOutOfMemory) or (isinstance(exc, ForwardRefused) and exc.kind in final):
                raise
            named = isinstance(exc, (ForwardRefused, CaptureFailed))  # failures that name the model's line
            if named:
                refusals.append((core.frontend.name, exc))
            if last:  # a refusal of the search names the model's code best: the first one, with the others'
                raise _with_others(refusals) if refusals else exc
            reasons.append(_reset_after(core, exc, candidate, candidates[index + 1]))
        finally:
            core.state.preparing = False
            clock.lap("front-end")  # what a refused front-end spent after its last phase
    if recorded is not None and core.frontend.name == recorded.name and not reasons:
        core.stats.frontend_reason = f"{store.entry_reason} (recorded in the cache by an earlier first call)"
    elif core.config.frontend == "auto" and not core.config.strict:
        core.stats.frontend_reason = "; ".join(reasons) or "Dynamo traced the forward as one graph with no blocker"
        if core.frontend.name == "breakable" and core.config.compiler != "eager":
            core.stats.frontend_reason += (f"; breakable with Inductor regions (compiler={core.config.compiler!r}): "
                                           f"{core.stats.compiled_regions} region(s) compiled between Dynamo's graph "
                                           f"breaks, the rest run as written")
    if not use_graphs:
        reason = "disabled by CaptureConfig(cuda_graphs=False)" if not core.config.cuda_graphs else "no CUDA"
        logger.info("piecewise: pieces run without CUDA graphs (%s)", reason)
    core.guard.record(arguments, list(core.arguments.dynamic), deep=not core.frontend.replays_python)
    clock.lap("guards")
    if core.config.verify != "off":
        sizes = core.ladder.sizes if core.config.verify == "all" else sorted({core.ladder.sizes[0],
                                                                             core.ladder.sizes[-1]})
        started = time.perf_counter()
        report = verify(core, arguments, sizes)
        core.stats.verify_seconds = time.perf_counter() - started
        core.stats.verified_sizes = list(sizes)
        logger.info("piecewise: verified %d size(s) in %.2f s", len(sizes), core.stats.verify_seconds)
        clock.lap("verify")
        if not report.ok:
            raise VerificationError(report)
    if store is not None:
        reason = store.entry_reason if recorded is taken else core.stats.frontend_reason
        store.save(key, described, {"frontend": taken.name, "options": taken.options,
                                    "graph_mode": core.stats.graph_mode, "frontend_reason": reason,
                                    "first_call_s": time.perf_counter() - began})
        clock.lap("cache")


def _open_cache(core: Core):
    """(the store, the model's key, what it hashes, the recorded candidate to try first) or Nones when off."""
    from .. import cache

    store, key, described, entry = cache.open_entry(core.model, core.config, list(core.arguments.dynamic))
    if store is None:
        core.stats.cache = "off"
        return None, None, None, None
    core.stats.cache = "miss"
    if entry is not None and (core.config.frontend != "auto" or core.config.strict):
        core.stats.cache = "hit, front-end given by the config"  # its compiler choice may still be taken
    if entry is None or core.config.frontend != "auto" or core.config.strict:
        return store, key, described, None
    candidate = next((c for c in _candidates(core) if c.name == entry["frontend"] and
                      c.options == entry.get("options", {})), None)
    if candidate is None:
        core.stats.cache = f"hit, not taken: {entry['frontend']} is not among this config's front-ends"
        return store, key, described, None
    core.stats.cache = "hit"
    store.entry_reason = str(entry.get("frontend_reason") or entry["frontend"])
    logger.info("piecewise: the cache (%s) recorded the %s front-end for this model: it is tried first (%s); "
                "`piecewise cache clear` forgets it", store.root, candidate.name, store.entry_reason)
    return store, key, described, candidate


def _rehearse(core: Core, arguments: dict[str, Any], count: int) -> Any:
    """The forward unpadded at ``count`` tokens: the first call's leading rows, or, one past them, its first row
    repeated at the end."""
    tokens = core.arguments.rows(arguments)
    given = core.arguments.given_tokens(arguments)
    made = core.arguments.made(arguments, count)
    try:
        return core.run_call(Call(Phase.PADDED, count, count), direct_tokens(made, given), rehearsal=True)
    except Exception as exc:
        if count == tokens:  # the warm-up's own rows
            refuse_if_not_repeatable(core, arguments, exc)
        if count < tokens:  # rows past the call's own: its first rows repeated (a batch-first call is named later)
            refuse_if_rows_refused(core, made, count, count, arguments, exc)
        raise


def _with_others(refusals: list[tuple[str, Exception]]) -> Exception:
    """The first front-end's refusal, its message followed by what the others refused (a shape condition Dynamo
    saw may follow from a read breakable names: a per-token tensor read from a global)."""
    first = refusals[0][1]
    others = [f"The {name} front-end refused it too: {str(exc).removeprefix('piecewise: ')}"
              for name, exc in refusals[1:] if str(exc) != str(first)]
    if others and first.args and isinstance(first.args[0], str):
        first.args = ("\n\n".join([first.args[0], *dict.fromkeys(others)]), *first.args[1:])
    return first


def _reset_after(core: Core, exc: Exception, failing: Candidate, following: Candidate) -> str:
    """``frontend="auto"``: a front-end failed; drop what it made, warn once with the reasons and the fix that
    brings it back, and return a one-line reason."""
    failed = core.frontend.name
    if isinstance(exc, DynamoBlocked):
        reasons = [blocker.format() for blocker in exc.blockers]
        summary = f"Dynamo blocked ({len(reasons)} blocker(s))"
    else:
        inner = getattr(exc, "inner_exception", None) or exc
        reasons = [f"[{getattr(inner, 'kind', type(inner).__name__)}] {str(inner).removeprefix('piecewise: ')}"]
        summary = f"{failed} failed ({type(inner).__name__})"
    fusion = " (and compiler='inductor' fusion)" if failing.compiles and not following.compiles else ""
    warnings.warn(
        f"piecewise: the {failed} front-end cannot take this forward, so it runs with "
        f"{following.description or following.name}. Fix what is below to bring the {failed} front-end "
        f"back{fusion}, or choose a front-end with "
        f"CaptureConfig(frontend=...) to skip this search:\n" + "\n\n".join(reasons),
        stacklevel=7,
    )
    _reset(core)
    return summary


def _reset(core: Core) -> None:
    """Drop what the front-end in use made (graphs, pool, dropped sizes, trace counts) before the next."""
    if core.state.pool is not None:
        torch.cuda.synchronize()
    core.frontend.release()
    core.full.release()
    core.state.pool = core.state.workspace_graph = None
    core.state.retired_pools.clear()
    core.state.capture_done = False
    core.state.cut_runs, core.state.full_exact, core.state.host_branch = 0, False, None
    core.state.captured_this_size.clear()
    core.ladder.sizes[:] = core.config.sizes  # a size dropped for one front-end is served again
    core.ladder.notes.clear()
    core.stats.update(traces=0, pieces=0, eager_writes=0, graph_breaks=0, compiled_regions=0, captured_sizes=[],
                      warmed_sizes=[], graphs=0, full_only_sizes=[], full_warmed_sizes=[])
