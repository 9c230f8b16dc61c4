"""The first call's check of the token count as a value: the call's rows run as they are and padded must agree."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from ..errors import ForwardRefused, first_line
from ..frontends.user_frames import caller_stacklevel
from ..stored import values
from .checks import RandomState, _compared, _difference, _padded_run, _same
from .core import Core
from .full_graphs import restore, snapshot
from .model_state import state_tensors

logger = logging.getLogger(__name__)


def check_count(core: Core, arguments: dict[str, Any]) -> None:
    """The first call's leading rows, as many as a padded call can have (the most below its count that are not a
    capture size), run as they are and padded to the next capture size must give the same real rows: a forward
    that takes the token count for a value (``x / x.shape[0]``, ``arange(T)`` counted from the end, a mask of the
    last row, an expert capacity from the count, the count returned or kept) would see the padded count on every
    padded call. Where every count up to the call's is a capture size (a one-token first call), its rows padded to
    the two smallest sizes above them are compared instead. Not asked of a forward that draws random numbers
    (their layout follows the size)."""
    sizes = [size for size in core.ladder.sizes if size >= 2]
    if not sizes:
        return
    given = core.arguments.given_tokens(arguments)
    tokens = arguments[given[0]].shape[0]
    rows = reference = next((n for n in range(min(tokens, sizes[-1] - 1), 0, -1) if n not in core.ladder.sizes), None)
    if rows is None:  # no count up to the call's is padded: its rows padded twice (a branch the ladder bounds stays)
        rows, reference = min(tokens, sizes[0] - 1), sizes[0]
    size = next((size for size in sizes if size > reference), None)  # the padding a call of ``rows`` tokens gets
    if size is None:
        return
    first = RandomState()
    saved = snapshot(core, arguments)  # the state the runs write (rows at an offset from the end, a count kept)

    def run(size: int, made: dict[str, Any]) -> tuple[list[Any], list[torch.Tensor]]:
        restore(saved)
        output = _compared(_padded_run(core, made, given, rows, size, copies=False))
        return output, [tensor.clone() for tensor, _, _ in saved or ()]

    want, want_state = run(reference, arguments)  # unpadded (what eager computes), or padded to the smallest size
    draws = not first.same(RandomState())
    first.restore()
    if draws:
        warnings.warn(
            "piecewise: the forward draws random numbers. A padded call draws them for its padded rows, so each "
            "call's rows are as random as eager's, but the generator moves on by the padded count: after "
            "torch.manual_seed (or a generator of your own given to forward), a sequence of calls samples other "
            "numbers than the same calls run eagerly. Sample outside forward (as vLLM and SGLang do, after it) where "
            "runs must repeat eager's.",
            stacklevel=caller_stacklevel())
        return
    refusal = _compare(saved, rows, reference, size, (want, want_state), lambda at: run(at, arguments), first, "")
    if refusal is not None:
        raise refusal
    if rows < 2 or (saved is None and state_tensors(core, arguments)):  # made-up rows' writes could not be undone
        return
    # The call's rows all made copies of its first: the load a router puts on one expert is then the most it can
    # be, so a capacity computed from the count (GShard's ceil(T / E)) drops rows unpadded that padding keeps, even
    # where the call's own rows spread evenly. Rows the forward or piecewise refuses leave this part out.
    same = {**arguments, **{n: arguments[n][:1].expand(arguments[n].shape).clone() for n in given}}
    try:
        want = run(reference, same)
        if not first.same(RandomState()):
            raise RuntimeError("the forward draws random numbers on those rows")
        first.restore()
        refusal = _compare(saved, rows, reference, size, want, lambda at: run(at, same), first, _COPIES)
    except Exception as exc:  # noqa: BLE001 - made-up rows the forward (or piecewise's checks) need not take
        logger.info("piecewise: the check of the token count on copies of the first row is left out (%s)",
                    first_line(exc))
    finally:
        restore(saved)
        first.restore()
    if refusal is not None:
        raise refusal


_COPIES = ", every one a copy of the call's first (the most load a router can put on one expert)"


def _compare(saved: Any, rows: int, reference: int, size: int, want: tuple, run: Any, first: RandomState,
             made: str) -> ForwardRefused | None:
    """The refusal of the forward where the rows padded to ``size`` and ``want`` (run at ``reference``: as they
    are) differ, in an output or in what they write, and a repeat of the reference run does not differ from the
    first; None where they agree."""
    want, want_state = want
    got, got_state = run(size)
    first.restore()
    index = next((i for i, (a, b) in enumerate(zip(got, want)) if not _same([a], [b])), None)
    state = next((i for i, (a, b) in enumerate(zip(got_state, want_state))
                  if _compares(values(a, saved[i][0]))
                  and not _same([values(a, saved[i][0])], [values(b, saved[i][0])])), None)
    if index is None and state is None:
        return None
    again, again_state = run(reference)  # the first run repeated
    first.restore()
    if not (_same(again, want) and _same(again_state, want_state)):
        logger.info("piecewise: the forward gives other results on a repeat of the same run; the check of the token "
                    "count is left out")
        return None
    if index is None:
        got, want, index = [values(t, saved[state][0]) for t in got_state], [
            values(t, saved[state][0]) for t in want_state], state
        what = f"what it writes into {saved[state][2]}"
        causes = "rows written at an offset from the end (mem[-T:] = x), the count kept (buf.fill_(x.shape[0])), " \
                 "the rows counted into it by an op that does not declare the write (an expert-load count for " \
                 "EPLB, a histogram: name the tensor in the op's mutates_args, and piecewise runs the op on the " \
                 "real rows)"
    else:
        what = f"output {index} ({_what(want[index])})"
        causes = "a division by x.shape[0], arange(T) counted from the end or compared with the count (a mask of " \
                 "the last row), a capacity computed from the count, the count returned or kept, rows read at an " \
                 "offset from the end (x.roll(k, 0), x[-k])"
    return ForwardRefused(
        f"piecewise: the forward takes the token count for a value: with {rows} real token(s){made}, {what} differs "
        f"by {_difference(got[index], want[index])[0]:.1e} (relative) between "
        f"{'the call run as it is' if reference == rows else f'padding to {reference} tokens'} and padding to "
        f"{size} tokens. Every call is padded to a capture size, so such code sees the padded count: {causes}. "
        f"Give the count or the positions as a tensor argument, or make that code a splitting op "
        f"(piecewise.opaque_op(..., split=True)), which sees the real count and rows.",
        "token_mixing", [])


def _compares(state: torch.Tensor) -> bool:
    """Whether the check compares a state tensor: floating ones, and integers of 16 bits or more and flags (a count
    or a length kept, ``buf.fill_(x.shape[0])``). Not 8-bit codes: a quantised cache's flip with float32's last
    bit between the padded and the unpadded run."""
    return state.is_floating_point() or state.dtype not in (torch.uint8, torch.int8)


def _what(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"the number {value!r}"
