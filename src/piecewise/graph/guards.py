"""Shape guards Dynamo recorded while tracing, evaluated at token counts: where a trace depends on the count."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import torch

from .._compat import fake_mode_of


def full_paths(where: str) -> str:
    """torch shortens a user file's path in a guard's location by the length of its common prefix with
    torch's own directory (``/work/m/model.py`` → ``ork/m/model.py``); put back the path of the loaded module
    that ends with it."""

    def restore(match: re.Match) -> str:
        short = match.group(1)
        if os.path.exists(short):
            return match.group(0)
        files = {getattr(module, "__file__", None) for module in list(sys.modules.values())}
        found = sorted(f for f in files if isinstance(f, str) and f.endswith(short))
        return f"# {found[0]}:" if len(found) == 1 else match.group(0)

    return re.sub(r"# (\S+?):(?=\d)", restore, where)


def token_guard_failures(example_inputs: list[Any], sizes: list[int]) -> list[tuple[str, str, int]]:
    """Shape conditions recorded while tracing that some capture size violates: (condition, where, size), one
    per condition and size that violates it."""
    fake_mode = fake_mode_of(example_inputs)
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None:
        return []
    # The token count: dimension 0 of the tensor inputs. Other symbols (an integer held by a module, traced
    # unspecialised) keep the value they were traced with.
    tokens = {value.shape[0].node.expr for value in example_inputs if isinstance(value, torch.Tensor)
              and value.dim() > 0 and isinstance(value.shape[0], torch.SymInt)}
    for symbol, sources in getattr(shape_env, "var_to_sources", {}).items():  # tensors guarded but not inputs
        if any(re.search(r"\.size\(\)\[0\]$", _source_name(source)) for source in sources):
            tokens.add(symbol)
    recorded = shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else \
        getattr(shape_env, "var_to_val", {})
    failures = []
    for guard in getattr(shape_env, "guards", []):
        expr = guard.expr
        symbols = list(getattr(expr, "free_symbols", ()))
        if not tokens & set(symbols):  # no token count in it (a static trace serves its one size)
            continue
        for size in sizes:
            try:
                holds = bool(expr.subs({symbol: size if symbol in tokens else recorded.get(symbol, size)
                                        for symbol in symbols}))
            except TypeError:
                continue
            if not holds:
                sloc = getattr(guard, "sloc", None)
                where = getattr(sloc, "maybe_user_loc", None) or str(sloc or "unknown location")
                failures.append((str(expr), full_paths(where), size))
    return failures


def _source_name(source: Any) -> str:
    name = getattr(source, "name", "")
    return name() if callable(name) else str(name)
