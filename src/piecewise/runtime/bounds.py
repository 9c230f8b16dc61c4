"""The first call's probe of index bounds: the largest capture size run padded under ``BoundsCheck``; a size whose
padded run would index out of range is left out, with one warning."""

from __future__ import annotations

import warnings
from typing import Any

from ..capture.bounds import BoundsCheck, IndexOutOfRange
from ..capture.state import Call, Phase
from ..frontends.user_frames import chain_text, user_chain
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
        core.state.bounds = BoundsCheck(lambda: chain_text(user_chain()[-1:]) or "an unknown line")
        try:
            core.run_call(Call(Phase.PADDED, size, rows, checked=True), staged, rehearsal=True)
        except IndexOutOfRange as exc:
            failed = failed or (size, exc)
            core.ladder.drop_above(size - 1, f"calls of more than {size - 1} tokens run without graphs: padded to "
                                             f"{size} the forward's {_described(exc)}")
            continue
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


def _described(exc: IndexOutOfRange) -> str:
    return f"`{exc.op}` at {exc.where} would index {exc.value} in a dimension of {exc.extent}"
