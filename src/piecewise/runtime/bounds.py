"""The first call's probe of index bounds: the largest capture size run padded under ``BoundsCheck``; a size whose
padded run would index out of range is left out, with one warning. So are the sizes past the model's own limit:
where the padded run raises at a size the model's own forward refuses too (a buffer of 16 rows sliced by the count,
``h[:n] + x``), the largest size that runs is found by bisection and the ladder ends there."""

from __future__ import annotations

import traceback
import warnings
from typing import Any

import torch

from ..capture.bounds import BoundsCheck, IndexOutOfRange
from ..capture.state import Call, Phase
from ..context import forward_context
from ..errors import REFUSALS, ForwardRefused, first_line
from ..frontends.user_frames import caller_stacklevel, chain_text, current_line, is_user_file
from .arguments import other_token_dims
from .core import Core


def drop_sizes_out_of_range(core: Core, arguments: dict[str, Any]) -> None:
    """Run the largest capture size padded under ``BoundsCheck``; while it would index out of range, leave that size
    out (its calls run without graphs: the model's own limit) and try the next."""
    tokens = core.arguments.rows(arguments)
    given = core.arguments.given_tokens(arguments)
    failed = None
    while core.ladder.sizes:
        size = core.ladder.sizes[-1]
        rows = min(tokens, size)
        staged = core.stager.stage(core.arguments.leading(arguments, rows), given, rows, size)
        core.state.bounds = BoundsCheck(current_line)
        try:
            core.run_call(Call(Phase.PADDED, size, rows, checked=True), staged, rehearsal=True)
        except IndexOutOfRange as exc:
            failed = failed or (size, exc)
            core.ladder.drop_above(size - 1, f"calls of more than {size - 1} tokens run without graphs: padded to "
                                             f"{size} the forward's {_described(exc)}")
            continue
        except (RuntimeError, ValueError, IndexError) as exc:
            if isinstance(exc, (*REFUSALS, torch.OutOfMemoryError)) or not _own_refusal(core, arguments, size):
                raise  # (running out of memory: the caller's ``CaptureOutOfMemory``)
            _end_at_own_limit(core, arguments, size, exc)
        finally:
            core.state.bounds = None
        break
    if failed is None:
        return
    size, exc = failed
    if not core.ladder.sizes:
        raise ValueError(
            f"piecewise: padded to any capture size, the forward's {_described(exc)}: it indexes with the padded "
            f"size (a table of {exc.extent} rows read at range(size)?), so no size can be captured. Capture sizes "
            f"the table covers (max_tokens={exc.extent} or less).")
    top = core.ladder.sizes[-1]
    warnings.warn(
        f"piecewise: padded to {size} tokens the forward's {_described(exc)}, where a call of its real tokens "
        f"would not: it indexes with the padded size or the padding rows' values (a table of {exc.extent} rows read at "
        f"range(size)?). Sizes above {top} are not captured, and calls of more than {top} tokens run without graphs "
        f"(the model's own limit applies to them). CaptureConfig(max_tokens={top}) says so and silences this.",
        stacklevel=6)


def refuse_indices_past_rows(core: Core, arguments: dict[str, Any]) -> None:
    """The first call runs the forward on fewer rows than the call's (its checks; breakable's survey). A forward that
    indexes the rows with another argument of the call's (vLLM's logits_indices, `h[logits_indices]` inside
    forward) would index past them there: on CUDA a device-side assert, which ends the process's CUDA context. So,
    on CUDA, the model's own forward runs first on the fewest rows those runs take, under ``BoundsCheck``; an index
    past them refuses the forward (``checks.refuse_if_rows_refused``, naming the op, its line and the argument)."""
    from ..frontends.breakable import forget_frames  # (the front-ends import the runtime's parts)
    from .checks import index_arguments, refuse_if_rows_refused

    given = core.arguments.given_tokens(arguments)
    tokens = arguments[given[0]].shape[0]
    sizes = [size for size in core.ladder.sizes if size >= 2]
    if tokens < 2 or not sizes or not arguments[given[0]].is_cuda:
        return
    rows = min(tokens - 1, sizes[0] - 1)
    if not index_arguments(core, arguments, rows, tokens):
        return  # no argument that could index the rows: nothing to run (a run under a dispatch mode is not free)
    made = core.arguments.leading(arguments, rows)
    try:
        with torch.no_grad(), forward_context(rows, rows, rehearsal=True), BoundsCheck(current_line):
            core.model(**made)
    except IndexOutOfRange as exc:
        refuse_if_rows_refused(core, made, rows, rows, arguments, exc)
        raise
    except Exception as exc:  # noqa: BLE001 - anything else the first call's own runs name
        forget_frames(exc.__traceback__)  # what Dynamo marked while code it compiles (torch.cond) ran under the mode


def _padded_runs(core: Core, arguments: dict[str, Any], size: int) -> bool:
    tokens = core.arguments.rows(arguments)
    rows = min(tokens, size)
    staged = core.stager.stage(core.arguments.leading(arguments, rows), core.arguments.given_tokens(arguments),
                               rows, size)
    try:
        core.run_call(Call(Phase.PADDED, size, rows), staged, rehearsal=True)
        return True
    except (RuntimeError, ValueError, IndexError) as exc:
        if isinstance(exc, (*REFUSALS, torch.OutOfMemoryError)):
            raise
        return False


def _own_refusal(core: Core, arguments: dict[str, Any], size: int) -> bool:
    """Whether the model's own forward refuses ``size`` rows made from the first call's (its rows repeated)."""
    made = core.arguments.made(arguments, size)
    try:
        with forward_context(size, size, rehearsal=True):
            core.model(**made)
    except Exception:  # noqa: BLE001 - the model's own verdict on those rows
        return True
    return False


def _end_at_own_limit(core: Core, arguments: dict[str, Any], size: int, exc: Exception) -> None:
    """The top size's padded run raised ``exc`` and the model's own forward refuses that many rows: end the ladder
    at the largest size whose padded run runs (bisection), with one warning; none: refused."""
    sizes = core.ladder.sizes
    low, high = -1, len(sizes) - 1  # sizes[high] fails; sizes[low] runs (-1: none known)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if _padded_runs(core, arguments, sizes[middle]) else (low, middle)
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if is_user_file(frame.filename)]
    where = chain_text(frames[-1:]) or "a line of the forward"
    if low < 0:
        raise ForwardRefused(
            f"piecewise: padded to any capture size the forward raises {first_line(exc, 200)} at {where}, as the "
            f"model's own forward does on {size} rows: no size can be captured. It takes fewer rows than the "
            f"smallest capture size ({sizes[0]})?", "token_layout") from exc
    top, failing = sizes[low], sizes[high]  # (the ladder's own list: dropping sizes shortens it)
    core.ladder.drop_above(top, f"calls of more than {top} tokens run without graphs: padded to {failing} or more "
                                f"the forward raises, as the model's own forward does on {size} rows")
    warnings.warn(
        f"piecewise: padded to {size} tokens the forward raises {first_line(exc, 200)} at {where}, and the model's "
        f"own forward refuses {size} rows too; padded to {failing} it raises, to {top} it runs (a buffer of {top} "
        f"rows or so, sliced by the count?). Sizes above {top} are not captured, and calls of more than {top} tokens "
        f"run the model's own forward (its own limit applies to them). CaptureConfig(max_tokens={top}) says so and "
        f"silences this.{other_token_dims(core.arguments, arguments, core.arguments.rows(arguments))}",
        stacklevel=caller_stacklevel())


def _described(exc: IndexOutOfRange) -> str:
    return f"`{exc.op}` at {exc.where} would index {exc.value} in a dimension of {exc.extent}"
