"""A forward that fails on a later run of the first call because its earlier runs advanced state of its own."""

from __future__ import annotations

from typing import Any

import torch

from ..context import forward_context
from ..errors import CaptureBlockedError, CaptureFailed, ForwardRefused, first_line


def refuse_if_not_repeatable(core: Any, arguments: dict[str, Any], error: Exception) -> None:
    """``error`` came from a run the first call made. Where the model's own forward now raises on the first call's
    own arguments, which its warm-up took, refuse naming state the forward advances on every run."""
    if isinstance(error, (ForwardRefused, CaptureFailed, CaptureBlockedError)):
        return
    tokens = core.arguments.rows(arguments)
    try:
        with torch.no_grad(), forward_context(tokens, tokens, rehearsal=True):
            core.model(**arguments)
        return
    except Exception:  # noqa: BLE001 - the model's own verdict
        pass
    raise ForwardRefused(
        f"piecewise: the forward raised {first_line(error)} on a later run of the first call, and the model's own "
        f"forward now raises on the first call's own arguments too, which its first run took: the first call runs "
        f"the forward several times (warm-up, checks, a capture per size), and state the forward advances on every "
        f"run (a counter in a global or a context object, vLLM's moe_layer_index under fast_moe_cold_start) goes on "
        f"from where the last run left it. Reset it at the start of forward, or advance it outside forward.",
        "state_update", []) from error
