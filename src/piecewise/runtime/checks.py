"""The first call's checks of a forward against padding and repeated runs.

- ``check_padding``: the first call's leading tokens padded by one row, the padding zero and then copies of real
  rows; the real rows must not change.
- ``check_one_token``: after a trace that holds for more than one token only, a one-token call padded to the next
  size must equal the model's own one-token result.
- ``ModuleState``: the Python attributes of the model's modules, taken before the first call (put back if it is
  refused) and compared across its runs (the forward must not change them: replays run no Python).
"""

from __future__ import annotations

import contextlib
import logging
import traceback
import warnings
from typing import Any

import torch

from .. import _compat
from ..capture.bounds import INDEX_DTYPES, BoundsCheck, IndexOutOfRange
from ..capture.outputs import output_tensors, unmapped_leaves, walk_tensors
from ..capture.state import Call, Phase
from ..context import forward_context
from ..errors import ForwardRefused, first_line
from ..frontends.user_frames import chain_text, current_line, is_user_file
from ..stored import values
from .arguments import nested_rows, other_token_dims
from .random_state import RandomState
from .rerun import refuse_if_not_repeatable
from .core import Core
from .full_graphs import restore, snapshot
from .model_state import global_tensors
from .verify import rel_error, tolerance

logger = logging.getLogger(__name__)

_IMMUTABLE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def check_padding(core: Core, arguments: dict[str, Any]) -> None:
    """Run the first call's leading tokens padded by one row, after a run that traces (Dynamo) and builds what the
    forward builds on first use, the padding rows zero and then copies of real rows (the generators put back in
    between), and once more with the generators moved on: the breakable front-end compares the runs' op logs, and a
    value drawn in Python differs in the last. A forward whose pieces compute each row from that row alone
    (attention and other cross-token code in splitting ops) gives the same real rows both times; one that mixes rows
    (a sum or softmax over the tokens, ``x[-1]``) would return padding-dependent numbers on every padded call:
    refused here. The state both runs write is compared too (rows mixed into a write). Where that ran one real row,
    two more runs pad two or more; and two more pad the rows after the first (a first row at position 0 holds what
    zero padding does: a minimum or ``any()`` over the positions would pass)."""
    sizes = [size for size in core.ladder.sizes if size >= 2]
    if not sizes:
        return
    given = core.arguments.given_tokens(arguments)
    tokens = arguments[given[0]].shape[0]
    plans = [(sizes[0], min(tokens, sizes[0] - 1), arguments)]
    wider = next((s for s in sizes if s >= 3), None)  # two real rows or more: a first row at position 0 holds
    if wider is not None and tokens >= 2 and plans[0][1] < 2:  # what zero padding does
        plans.append((wider, min(tokens, wider - 1), arguments))
    if wider is not None and tokens >= 2:  # and without the first row, which hides what the padding's zeros change
        rows = min(tokens - 1, wider - 1)  # (a minimum or any() over the positions of a prefill from position 0)
        plans.append((wider, rows, {**arguments, **{n: arguments[n][1:rows + 1].clone() for n in given}}))
    first = RandomState()
    for plan, (size, rows, made) in enumerate(plans):
        results, saved, written, copied = [], None, None, None
        try:
            for fill in ("trace", "zeros", "copies", "again") if plan == 0 else ("zeros", "copies"):
                if fill == "zeros":
                    drawn = RandomState()
                    saved = snapshot(core, arguments)  # the state both compared runs start from
                    if made is not arguments and saved is None:
                        raise RuntimeError("its state could not be put back after")  # rows written elsewhere
                elif fill == "copies":
                    drawn.restore()  # both compared runs draw the same random numbers: only the padding differs
                    written = [tensor.clone() for tensor, _, _ in saved or ()]
                    restore(saved)
                results.append(_padded_run(core, made, given, rows, size, copies=fill == "copies"))
                if fill == "copies":
                    copied = [tensor.clone() for tensor, _, _ in saved or ()]
        except Exception as exc:  # noqa: BLE001 - the rows without the first one: the forward may refuse them
            if made is arguments:
                raise
            restore(saved)
            first.restore()
            logger.info("piecewise: the padding check without the first call's first row is left out (%s)",
                        first_line(exc))
            continue
        zeros, copies = results[-3 if plan == 0 else -2:][:2]
        try:
            _compare_state(core, saved, written, copied, rows, size)
            _compare_outputs(core, zeros, copies, rows, size)
        except ForwardRefused:
            drawn.restore()  # the zero-padded run once more: a forward that races (an unjoined side stream) or
            restore(saved)  # is otherwise not repeatable differs from itself, which is not the padding's doing
            again = _padded_run(core, made, given, rows, size, copies=False)
            if _same(_compared(zeros), _compared(again)) and _same(written or [], [t for t, _, _ in saved or ()]):
                raise
            logger.info("piecewise: the forward gives other results on a repeat of the same padded run; the padding "
                        "check at %d tokens is left out", size)
        if made is not arguments:
            restore(saved)  # its rows were written where the call's first rows belong (a slot per row)
        first.restore()


def _padded_run(core: Core, arguments: dict[str, Any], given: list[str], rows: int, size: int, copies: bool) -> Any:
    """The first call's leading ``rows`` padded to ``size``, the pad rows zero or (``copies``) copies of real rows."""
    staged = core.stager.stage(core.arguments.leading(arguments, rows), given, rows, size)
    if copies:
        core.stager.fill_padding_with_copies(arguments, given, rows, size)
    try:
        output = core.run_call(Call(Phase.PADDED, size, rows), staged, rehearsal=True)
    except Exception as exc:
        refuse_if_rows_refused(core, core.arguments.leading(arguments, rows), rows, size, arguments, exc)
        if type(exc) not in (RuntimeError, ValueError, ZeroDivisionError):  # not a trace's (its own types)
            raise
        raise _refused_padding(exc, rows, size) from exc
    return core.finish(output, rows, size, clone=True)


def _refused_padding(exc: Exception, rows: int, size: int) -> ForwardRefused:
    """The forward raised ``exc`` on ``rows`` real rows padded to ``size``, where the model's own forward takes
    those rows (``refuse_if_rows_refused`` asked it): the pad rows' values are the cause."""
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if is_user_file(frame.filename)]
    where = chain_text(frames[-1:])
    return ForwardRefused(
        f"piecewise: padded to {size} rows ({rows} real, the rest zeros), the forward raises {first_line(exc, 200)}"
        f"{' at ' + where if where else ''}, where the model's own forward takes the {rows} real rows. Every call "
        f"is padded to a capture size and the pad rows hold zeros in every token argument (a token id 0, position "
        f"0, a temperature or divisor of 0): the forward must accept them. Clamp such a value "
        f"(`temperature.clamp_min(1e-5)`), or move the code that cannot take a zero into a splitting op "
        f"(piecewise.opaque_op(..., split=True)), which sees only the real rows.", "token_layout",
        frames[-1:])


def _same(first: list, second: list) -> bool:
    """Equal, value by value, within the check's tolerance (``_difference``)."""
    return all(difference <= allowed for difference, allowed in (_difference(x, y) for x, y in zip(first, second)))


def _compare_outputs(core: Core, zeros_output: Any, copies_output: Any, rows: int, size: int) -> None:
    for index, (zeros, copies) in enumerate(zip(output_tensors(zeros_output), output_tensors(copies_output))):
        difference, allowed = _difference(zeros, copies)
        if not difference <= allowed:  # NaN included
            hint, chain = core.frontend.mixing_hint()
            if zeros.dim() and zeros.shape[0] not in (rows, size) and zeros.shape[0] > size:
                hint += (f" Its {zeros.shape[0]} rows for {size} padded tokens are not one per token: a cat of two "
                         f"per-token tensors, a flatten across the tokens or a pad by a row puts pad rows among the "
                         f"real ones. Return per-token tensors separately (a tuple) and combine them after the call.")
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


def _compare_state(core: Core, saved: list | None, written: list | None, copied: list | None, rows: int,
                   size: int) -> None:
    """The state the zero-padded run wrote (``written``) must equal what the run padded with copies of real rows
    wrote (``copied``): pad rows that reach a write (a value computed across the rows, ``h.flip(0)``, ``h[-1]``, a
    length from the last row's position) would write padding into it on every padded call."""
    for (original, _, name), zeros, tensor in zip(saved or (), written or (), copied or ()):
        difference, allowed = _difference(values(tensor, original), values(zeros, original))
        if not difference <= allowed:
            hint, chain = core.frontend.mixing_hint()
            raise ForwardRefused(
                f"piecewise: the forward mixes tokens into state it writes: with {rows} real token(s) padded to "
                f"{size}, what it writes into {name} changes by {difference:.1e} (relative) when the padding rows "
                f"hold other values. Every call is padded to a capture size, so the padding would reach that state "
                f"on every padded call. Code outside splitting ops reads rows other than its own (a value taken "
                f"from the last row, x[-1], a flip or a sort over the tokens) before it writes, or the pad rows "
                f"write into it themselves (an op that counts rows into state, an expert-load count for EPLB, a "
                f"histogram, without naming the tensor in its mutates_args; a cache write at a slot the pad rows "
                f"share).{hint} Make that code a splitting op (piecewise.opaque_op(..., split=True)), which sees "
                f"only the real rows, or name the written tensor in the op's mutates_args.",
                "token_mixing", chain)


def _difference(got: Any, want: Any) -> tuple[float, float]:
    """(relative difference, what is allowed) of two outputs of a padded run: floating tensors by norm
    (``verify.rel_error``), others (token ids, counts, masks, Python numbers) equal or not."""
    if not isinstance(want, torch.Tensor):
        return (0.0 if got == want else 1.0), 0.0
    if want.is_complex():
        return 0.0, 0.0
    allowed = (1e-4 if want.dtype in (torch.float32, torch.float64) else 1e-2) if want.is_floating_point() else 0.0
    return (rel_error(got, want) if isinstance(got, torch.Tensor) else 1.0), allowed


def _compared(output: Any) -> list[Any]:
    """An output's tensors and its Python numbers, in order."""
    numbers = [value for _, value in unmapped_leaves(output) if isinstance(value, (int, float)) and
               not isinstance(value, bool)]
    return [*output_tensors(output), *numbers]


def refuse_if_rows_refused(core: Core, made: dict[str, Any], rows: int, size: int, arguments: dict[str, Any],
                           error: Exception) -> None:
    """A first-call run of ``made`` (``rows`` rows made from the first call's ``arguments``, padded to ``size``)
    raised ``error`` in the forward: where the model's own forward refuses those rows too (per-sequence lengths or
    offsets that must add up to the call's rows), a ``ForwardRefused`` saying what piecewise ran and what the
    arguments must allow. Piecewise's own refusals, and errors the model's own forward does not raise, are left
    to propagate. The model's own forward runs here as a rehearsal: state it writes in place (a cache in buffers)
    gets the rows it is given, as the first call's other runs do."""
    from ..errors import CaptureBlockedError, CaptureFailed

    if isinstance(error, (ForwardRefused, CaptureFailed, CaptureBlockedError)):
        return  # (a trace's error where the model's own forward takes the rows is the trace's: propagated below)
    tokens = arguments[core.arguments.given_tokens(arguments)[0]].shape[0]
    given = {t.untyped_storage().data_ptr() for value in arguments.values() for _, t in walk_tensors(value)
             if t is not None}  # a global that is the call's own argument (a notebook's `ids`) is not the cause
    nested = nested_rows(arguments, tokens) + [
        name for name, t in global_tensors(core.model)
        if t.dim() > 0 and t.shape[0] == tokens and t.untyped_storage().data_ptr() not in given]
    # An index into the rows (vLLM's logits_indices, taken inside forward). On CUDA such an index is a device-side
    # assert instead, which ends the process's CUDA context: only a CPU run gets here with it.
    indexing = index_arguments(core, arguments, rows, tokens) \
        if "out of bounds" in str(error) or isinstance(error, IndexOutOfRange) else {}
    if indexing:
        refusal = (f"{first_line(error)}. Argument(s) {', '.join(f'`{n}`' for n in indexing)} index the call's rows "
                   f"(up to {max(indexing.values())}) but do not have one row per token. Index "
                   f"the output after the runner returns (as vLLM computes the logits at its logits_indices after "
                   f"the model's forward), or inside a splitting op, which sees the real rows")
    elif nested:  # they are the cause: their rows stayed the first call's (eager may even broadcast them)
        refusal = (f"{first_line(error)}. Tensors inside an argument or read from a global do not carry tokens, "
                   f"only tensor arguments of forward do: {', '.join(nested)} kept the first call's {tokens} rows. "
                   f"Pass them as arguments of forward (a wrapper module can unpack an object)")
    else:
        # A trace's error (Dynamo's fake tensors, the token count symbolic) may come from rows the model's own
        # forward takes only by broadcasting one row: its verdict is asked on a second count too.
        counts = [rows] + ([tokens - 1] if isinstance(error, _compat.TRACE_ERROR) and tokens - 1 not in (rows, 0, 1)
                           else [])
        refusal = None
        for rows in counts:
            made = core.arguments.leading(arguments, rows) if rows != counts[0] else made
            try:  # (on CUDA with the index bounds checked: an index past the rows would end the CUDA context)
                with torch.no_grad(), forward_context(rows, rows, rehearsal=True), \
                        BoundsCheck(current_line) if _on_cuda(made) else contextlib.nullcontext():
                    core.model(**made)
            except Exception as own:  # noqa: BLE001 - the model's own verdict on those rows
                refusal = first_line(own)
                size = max(size, rows)
                break
        if refusal is None:
            return
        refuse_if_not_repeatable(core, arguments, error)  # the call's own rows fail too: not the rows' doing
    raise ForwardRefused(
        f"piecewise: the forward refuses a call of {rows} rows made from the first call's {tokens} ({refusal}). "
        f"Every call runs padded, and the first call runs the forward on other row counts (here {rows}, padded to "
        f"{size}) to check the padding and to capture each size, so the arguments must describe any rows taken "
        f"from a call: per-token metadata (a position, a cache slot, a sequence index per token) does; per-sequence "
        f"lengths or cumulative offsets that must add up to the call's rows do not. Pass per-token arguments and "
        f"derive what a kernel needs inside a splitting op (piecewise.opaque_op(..., split=True)), which sees the "
        f"real rows." + other_token_dims(core.arguments, arguments, tokens),
        "token_layout",
    ) from error


def index_arguments(core: Core, arguments: dict[str, Any], rows: int, tokens: int) -> dict[str, int]:
    """Arguments (not token arguments) holding a 1-D integer tensor, at any depth, whose largest value could index
    the call's rows but not ``rows`` of them (vLLM's logits_indices), each with that value (a wait for the device
    per such tensor)."""
    found = {}
    for name, argument in arguments.items():
        if name in core.arguments.dynamic:
            continue
        for _, value in walk_tensors(argument):
            if value is not None and value.dim() == 1 and value.numel() and value.dtype in INDEX_DTYPES \
                    and rows <= (largest := int(value.max())) < tokens:
                found[name] = max(found.get(name, largest), largest)
    return found


def _on_cuda(arguments: dict[str, Any]) -> bool:
    return any(isinstance(value, torch.Tensor) and value.is_cuda for value in arguments.values())


def check_one_token(core: Core, arguments: dict[str, Any]) -> None:
    """A trace that holds for more than one token only pads one-token calls to the next size
    (``Ladder.drop_one``): right where the assumption is broadcasting's (``x[index] = values``), wrong where the
    forward branches on the count. Such a call must equal the model's own one-token forward."""
    if not core.ladder.notes:
        return
    size = core.ladder.sizes[0]
    given = core.arguments.given_tokens(arguments)
    tokens = core.arguments.token_count(arguments)
    # The first token and the last: at the first position a decode over a cache and a prefill among the call's own
    # tokens see the same single key, so a branch between them (gpt-fast's ``if seqlen > 1``) shows at the last.
    for row in (0, tokens - 1) if tokens > 1 else (0,):
        one = {**arguments, **{name: arguments[name][row:row + 1] for name in given}}
        staged = core.stager.stage(one, given, 1, size)
        saved, drawn = snapshot(core, arguments), RandomState()  # both runs start from the same state and draws
        padded = core.finish(core.run_call(Call(Phase.PADDED, size, 1), staged, rehearsal=True), 1, size, clone=True)
        restore(saved)
        drawn.restore()
        with forward_context(1, 1, rehearsal=True):
            exact = core.model(**one)  # the model's own forward on the real row (it writes what the padded call wrote)
        for got, want in zip(output_tensors(padded), output_tensors(exact)):
            if not rel_error(got, want) <= tolerance(want.dtype):
                raise ForwardRefused(
                    f"piecewise: a call of 1 token (row {row} of the first call) padded to {size} differs from the "
                    f"model's own 1-token result ({rel_error(got, want):.1e}): {core.ladder.notes[0]}, and the "
                    f"forward's numbers depend on that. It branches on the token count: move the branch out of "
                    f"forward (a runner per path), or make the code that depends on the count a splitting op "
                    f"(piecewise.opaque_op(..., split=True)).",
                    "token_branch")


def _fingerprint(value: Any) -> Any:
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, tuple) and all(isinstance(v, _IMMUTABLE) for v in value):
        return value
    if isinstance(value, (list, dict, set)):
        return (id(value), len(value))
    return ("object", id(value))


class ModuleState:
    """The plain attributes of every module of a model (not its parameters, buffers or submodules)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.saved = {(name, key): (module, value, _copy(value))
                      for name, module in model.named_modules() for key, value in vars(module).items()
                      if key not in _compat.MODULE_BOOKKEEPING}
        self.fingerprints = self.take()
        self.places: list[tuple[str, str]] = []
        """(module name, attribute) of what the last ``changed`` found."""

    def take(self) -> dict[tuple[str, str], Any]:
        return {(name, key): _fingerprint(value) for name, module in self.model.named_modules()
                for key, value in vars(module).items() if key not in _compat.MODULE_BOOKKEEPING}

    def changed(self) -> list[str]:
        """``module.attribute: before -> now`` for each attribute a run changed since the last ``changed``."""
        now, before = self.take(), self.fingerprints
        found, self.places = [], []
        for place in sorted(set(now) | set(before)):
            was, is_ = before.get(place, _GONE), now.get(place, _GONE)
            if was != is_:
                self.places.append(place)
                values = f" ({was!r} -> {is_!r})" if isinstance(was, _IMMUTABLE) and isinstance(is_, _IMMUTABLE) \
                    else " (set by the forward)" if was is _GONE else ""
                found.append(f"`{_label(*place)}`{values}")
        self.fingerprints = now
        return found

    def restore(self) -> None:
        """Put back each attribute as it was when this was taken (containers' contents too)."""
        for (name, key), (module, value, copy) in self.saved.items():
            if isinstance(value, list):
                value[:] = copy
            elif isinstance(value, (dict, set)):
                value.clear()
                value.update(copy)
            vars(module)[key] = value
        saved = self.saved
        for name, module in self.model.named_modules():
            for key in [k for k in vars(module) if k not in _compat.MODULE_BOOKKEEPING and (name, k) not in saved]:
                del vars(module)[key]


_GONE = object()


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else \
        set(value) if isinstance(value, set) else None


def _label(name: str, key: str) -> str:
    return f"{name}.{key}" if name else f"self.{key}"


def warn_changed_state(changed: list[str]) -> None:
    """The forward changed Python attributes of the model from one run to the next, and replays run no Python."""
    if changed:
        warnings.warn(
            f"piecewise: the forward changes the model's Python attributes {', '.join(changed[:5])} on every run. "
            f"Calls replayed from CUDA graphs run no Python, so it will not change on them (and where an op reads it, "
            f"the first call refuses the forward, as a value its graphs would keep). Keep such state out of forward, "
            f"or count in a tensor inside a splitting op that skips piecewise.context().rehearsal.", stacklevel=7)
