"""``CaptureConfig(compiler="auto")``: the piece compiler chosen by measurement at the first call.

Each candidate compiler (``eager``, then ``inductor``) gets a runner of its own on the same model, prepared on the
first call's arguments (its front-end chosen as ``frontend`` says, its checks run, every size captured), then timed
at a few representative token counts (1, 8, 32 and the top of the graphs) with calls made from the first call's
rows. Where Inductor pieces on the Dynamo front-end pad one-token calls to 2 (a trace that holds for more than one
token only), Inductor on the breakable front-end is a third candidate: it serves one token. The calls are rehearsals
(``piecewise.context().rehearsal``): splitting ops that keep state across calls skip them; the state the calls could
write (static tensor arguments, the model's buffers) is copied after the first candidate's first call and put back
after each candidate's timing calls (sizes above the first call's count are timed only where that copy fits, on
every rank: their repeated rows may write rows the first call did not). The fastest candidate's runner becomes this
one (a later one only when more than ``MARGIN`` faster); the others' graphs and pools are released. Candidates are
tried in order while the first calls' seconds stay within ``compile_budget_s``; past it, the fastest of those
measured is taken.

The choice, with every candidate's times, goes into ``stats["frontend_reason"]`` and ``stats["candidates"]``, and
into the persistent cache (``piecewise.cache``): a later process takes the recorded compiler without the search.
Without CUDA graphs there is nothing to measure: ``eager`` is taken (same outputs, no compile).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from typing import Any

import torch

from ..errors import first_line

logger = logging.getLogger(__name__)

CANDIDATES = ("eager", "inductor")
SIZES = (1, 8, 32)
MARGIN = 0.05
"""A candidate after the first (Inductor after eager) is taken only when its ms are this much lower (the geometric
mean over the timed sizes of its ms over eager's): a tie within the noise keeps eager pieces (no compile in later
processes, eager's exact numerics)."""
MEASURE_WITHOUT_CUDA = False
"""Tests set it to run the search on a CPU (no graphs: the times mean nothing there)."""


def measures(runner) -> bool:
    """Whether the search has something to measure: CUDA graphs of a model on CUDA (the same answer on every rank
    of a process group, which all run the search or none)."""
    devices = {t.device.type for t in (*runner.model.parameters(), *runner.model.buffers())}
    return (runner.config.cuda_graphs and "cuda" in devices and torch.cuda.is_available()) or MEASURE_WITHOUT_CUDA


def unmeasured(runner, seconds: float) -> None:
    """``runner`` prepared with eager pieces since there was nothing to measure: its table and reason say so."""
    runner.stats.candidates = [{"compiler": "eager", "first_call_s": seconds, "ms": {}}]
    reason = "compiler 'eager' (no CUDA graphs: nothing to measure, eager pieces compile nothing)"
    runner.stats.frontend_reason = (runner.stats.frontend_reason + "; " if runner.stats.frontend_reason else "") + reason


def choose(runner, args: tuple, kwargs: dict) -> None:
    """Replace ``runner``'s state with that of the fastest candidate's prepared runner (where ``measures``; else
    the runner is prepared with eager pieces as it is, and ``unmeasured`` says so)."""
    from .. import cache

    config = runner.config
    arguments = runner.arguments.bind(args, kwargs)
    runner.arguments.token_count(arguments)
    store, key, described, entry = cache.open_entry(runner.model, config, list(runner.arguments.dynamic))
    recorded = entry.get("compiler") if entry is not None else None
    forced = entry.get("candidate_frontend") if entry is not None else None
    index = CANDIDATES.index(recorded) + 1 + 2 * (forced == "breakable") if recorded in CANDIDATES else 0
    highest, lowest = _agreed([index, -index])
    if highest != -lowest:  # ranks whose caches differ: every rank searches (their first calls meet)
        recorded = None
    if recorded in CANDIDATES:
        order, why = [(recorded, forced)], "recorded in the cache by an earlier first call"
    else:
        order, why = [(name, None) for name in CANDIDATES], ""
    rows, spent, failures = _trials(runner, arguments, order, config)
    if not any("runner" in r for r in rows) and recorded is not None:  # the recorded one fails now
        order, why = [(name, None) for name in CANDIDATES], \
            f"the recorded {_label(rows[0])!r} failed now: {rows[0].get('error', '')}"
        rows, spent, failures = _trials(runner, arguments, order, config)
    measured = [r for r in rows if "runner" in r]
    if not measured:  # no candidate takes the model: the first one's refusal names what to fix
        raise failures[0]
    if len(rows) < len(order) and not why:  # stopped before the last candidate
        why = f"compile budget {config.compile_budget_s:.0f} s spent after " + ", ".join(_label(r) for r in rows)
    common = set.intersection(*(set(r["ms"]) for r in measured)) if all(r["ms"] for r in measured) else set()
    totals = _scores(rows, common)
    chosen = measured[0]
    for row in measured[1:]:  # a later (compiling) candidate must win by the margin: noise never buys its rounding
        if totals[id(row)] < totals[id(chosen)] * (1 - MARGIN):
            chosen = row
    for row in measured:
        if row is not chosen:
            row["runner"].release_graphs()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    table = [{k: v for k, v in row.items() if k != "runner"} for row in rows]
    if not why or why.startswith("the recorded"):
        why = (why + "; " if why else "") + "measured: " + "; ".join(
            f"{_label(r)} " + (", ".join(f"{n}: {ms:.3f} ms" for n, ms in r["ms"].items()) if "ms" in r
                               else r["error"]) for r in rows) + f" -> {_label(chosen)}" + (
            f" (Inductor is taken only when more than {MARGIN:.0%} faster)" if chosen is measured[0] and any(
                totals[id(r)] < totals[id(chosen)] for r in measured[1:]) else "")
    if not common and len(measured) > 1:
        why += "; no token count was timed by every candidate: the first is kept, and not recorded"
    trial = chosen["runner"]
    # One attribute dict for both: the trial's parts that point back at it (its full graphs, its front-end's
    # callbacks) see what the runner assigns later (a token argument first given after the first call, ...).
    moved = runner.arguments.moved  # the trials took the arguments tokens-first; the user's calls come in their layout
    runner.__dict__ = trial.__dict__
    runner.arguments.moved = moved
    runner.stats.candidates = table
    runner.stats.frontend_reason = (runner.stats.frontend_reason + "; " if runner.stats.frontend_reason else "") + \
        f"compiler {chosen['compiler']!r} ({why})"
    logger.info("piecewise: compiler %r (%s)", _label(chosen), why)
    if store is not None and (common or len(measured) == 1):  # a choice measured on nothing is not recorded
        store.save(key, described, {"frontend": runner.stats.frontend, "options": {},
                                    "compiler": chosen["compiler"], "candidates": table,
                                    "candidate_frontend": chosen.get("frontend"),
                                    "graph_mode": runner.stats.graph_mode,
                                    "frontend_reason": runner.stats.frontend_reason, "first_call_s": spent})


def _agreed(values: list[float]) -> list[float]:
    """Each of ``values``' largest over the ranks when ``torch.distributed`` runs (else ``values``): the ranks of
    a tensor-parallel model must try the same candidates, since their first calls meet at collectives, and take
    the same one."""
    from .capture_sizes import distributed

    if not distributed():
        return list(values)
    import torch.distributed as dist

    backend = str(dist.get_backend())  # "gloo", "nccl", "cpu:gloo,cuda:nccl", "undefined" (both), ...
    on_cpu = any(name in backend for name in ("gloo", "mpi", "undefined")) or not torch.cuda.is_available()
    tensor = torch.tensor(values, dtype=torch.float64, device="cpu" if on_cpu else f"cuda:{torch.cuda.current_device()}")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _scores(rows: list[dict], sizes: set) -> dict[int, float]:
    """Each row's time (by ``id``) as the geometric mean over ``sizes`` of its ms over the first measured row's:
    every representative size counts alike (summed milliseconds would let the top size's prefill drown the decode
    steps). Every rank takes the same candidate: each time is the slowest rank's."""
    sizes = sorted(sizes)  # the same on every rank: the same counts timed (``_trials``)
    if not sizes:
        return {id(row): 1.0 if "runner" in row else math.inf for row in rows}
    flat = iter(_agreed([row["ms"][n] if "runner" in row else math.inf for row in rows for n in sizes]))
    times = [[next(flat) for _ in sizes] for _ in rows]
    base = next(t for t, row in zip(times, rows) if "runner" in row)
    return {id(row): math.exp(statistics.fmean(math.log(ms / first) for ms, first in zip(t, base)))
            if "runner" in row else math.inf for t, row in zip(times, rows)}


def _label(row: dict) -> str:
    return row["compiler"] + (f" on {row['frontend']}" if row.get("frontend") else "")


def _one_token_alternative(trial, compiler: str, config, order: list) -> tuple[str, str] | None:
    """Inductor pieces on the Dynamo front-end whose trace pads one-token calls to 2 (it holds for more than one
    token only): the breakable front-end's Inductor regions serve one token (a decode step, and its exact full
    graph), so they are a candidate too, with ``frontend="auto"``."""
    alternative = (compiler, "breakable")
    if config.frontend != "auto" or config.strict or compiler == "eager" or alternative in order or len(order) < 2:
        return None
    return alternative if trial.stats.frontend == "dynamo" and trial.ladder.notes else None


def _trials(runner, arguments: dict[str, Any], order: list, config) -> tuple[list, float, list]:
    """Each (compiler, front-end or None: as ``config.frontend`` says) of ``order`` prepared and timed while the
    first calls' seconds stay within the budget: (rows of the table, seconds spent, the exceptions of those that
    failed). ``order`` grows by ``_one_token_alternative``."""
    from .full_graphs import restore, snapshot

    rows, spent, failures = [], 0.0, []
    saved, fits = None, False
    order = list(order)
    for compiler, frontend in order:
        restore(saved)  # each later candidate starts from the state the first one's first call left
        spent_all = any("runner" in r for r in rows) and spent > config.compile_budget_s
        if rows and _agreed([float(spent_all)])[0]:  # any rank past the budget stops every rank
            break
        given = dataclasses.replace(config, compiler=compiler, **({"frontend": frontend} if frontend else {}))
        trial = type(runner)(runner.model, given, dict(runner.arguments.dynamic))
        trial.arguments.dynamic_given = runner.arguments.dynamic_given  # found, not given: later tensors too
        started = time.perf_counter()
        try:
            trial.capture(**arguments)
            error = None
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot take the model is a row of the table
            error = exc
        if error is None and _agreed([0.0])[0]:  # it failed on another rank: no rank takes or times it
            trial.release_graphs()
            error = RuntimeError(f"compiler={compiler!r} failed on another rank of the process group")
        elif error is not None:
            _agreed([1.0])
        if error is not None:
            failures.append(error)
            rows.append({"compiler": compiler, **({"frontend": frontend} if frontend else {}),
                         "error": first_line(error, 160)})
            continue
        first = time.perf_counter() - started
        spent += first
        if len(order) > 1 and not any("runner" in r for r in rows):
            # The state after a whole first call (what the forward builds on first use included), put back after
            # each candidate's timing calls. Every rank times the same counts: the copy fits on all or on none.
            saved = snapshot(trial, arguments)
            fits = not _agreed([float(saved is None)])[0]
        ms = _timed(trial, arguments, beyond=fits) if len(order) > 1 else {}
        restore(saved)
        rows.append({"compiler": compiler, **({"frontend": frontend} if frontend else {}), "first_call_s": first,
                     "ms": ms, "runner": trial})
        alternative = _one_token_alternative(trial, compiler, config, order)
        if _agreed([float(alternative is not None)])[0]:  # every rank tries the same candidates
            order.append((compiler, "breakable"))
    return rows, spent, failures


def _timed(trial, arguments: dict[str, Any], beyond: bool, rounds: int = 5,
           iters: int = 10) -> dict[int, float]:
    """ms per call at each representative token count up to the top of the graphs (1, 8, 32 and the top: a count
    the trial pads, one token where its trace holds for more only, is timed as it serves it), calls made from the
    first call's rows; counts above the first call's (its rows repeated, which may write state the first call did
    not: another sequence's cache rows where the row is the sequence) only where ``beyond``, the state being put
    back after."""
    tokens = trial.arguments.rows(arguments)
    top = trial.ladder.sizes[-1]
    sizes = sorted({s for s in (*SIZES, top) if s <= top and (beyond or s <= tokens)})
    times = {}
    kept = trial.last_arguments, dict(trial.stats)
    trial.timing = True
    try:
        for size in sizes:
            made = trial.arguments.made(arguments, size)  # past the call's rows: its rows repeated
            if not _rehearsed(trial, made, size):
                continue  # the forward refuses these rows (fewer or more than the first call's): not timed
            trial._call((), made)
            samples = []
            for _ in range(rounds):
                _sync()
                start = time.perf_counter()
                for _ in range(iters):
                    trial._call((), made)
                _sync()
                samples.append((time.perf_counter() - start) * 1e3 / iters)
            times[size] = statistics.median(samples)
    finally:
        trial.timing = False
        trial.last_arguments = kept[0]  # the first call's, for verify() and capture(): not the timing calls'
        trial.stats.update(**{k: v for k, v in kept[1].items() if k in ("padded_calls", "replays", "full_calls",
                                                                        "full_replays", "fallback_calls",
                                                                        "splitting_op_calls", "direct_calls")})
    return times


def _rehearsed(trial, made: dict[str, Any], size: int) -> bool:
    """One call of ``size`` rows made from the first call's (its leading rows, or its rows repeated), which the
    forward may refuse: a gpt-fast-style model whose cache holds fewer sequences than the ladder's top, per-sequence
    lengths that no longer add up to the rows. False, on every rank, where it raised on any."""
    try:
        trial._call((), made)
        failed = 0.0
    except Exception as exc:  # noqa: BLE001 - the model's own refusal; the user's calls of that size would see it
        logger.info("piecewise: compiler search: %d-row calls not timed (the forward raised %s)", size,
                    first_line(exc, 200))
        failed = 1.0
    return not _agreed([failed])[0]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
