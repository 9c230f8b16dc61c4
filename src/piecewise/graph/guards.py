"""Shape guards Dynamo recorded while tracing, evaluated at token counts: where a trace depends on the count."""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable
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
        holds = _evaluator(expr, symbols)
        for size in sizes:
            values = {symbol: size if symbol in tokens else recorded.get(symbol, size) for symbol in symbols}
            if holds(values) is False:
                sloc = getattr(guard, "sloc", None)
                where = getattr(sloc, "maybe_user_loc", None) or str(sloc or "unknown location")
                failures.append((str(expr), full_paths(where), size))
    return failures


def _evaluator(expr: Any, symbols: list) -> Callable[[dict], bool | None]:
    """A guard's condition as a function of its symbols' values (None: it cannot say). Printed to Python once
    (torch's printer of its own sympy functions, ``FloorDiv`` as ``//``), so a guard costs microseconds per count
    instead of a sympy substitution's milliseconds: a trace records hundreds of guards, checked at every count
    up to the largest size; sympy where the printed form fails."""

    def substituted(values: dict) -> bool | None:
        try:
            return bool(expr.subs(values))
        except TypeError:
            return None

    try:
        from torch.utils._sympy.printers import PythonPrinter

        code = compile(PythonPrinter().doprint(expr), "<guard>", "eval")
    except Exception:  # noqa: BLE001 - a form the printer does not know: sympy evaluates it
        return substituted
    names = [(str(symbol), symbol) for symbol in symbols]

    def printed(values: dict) -> bool | None:
        try:
            return bool(eval(code, {"math": math}, {name: values[symbol] for name, symbol in names}))
        except Exception:  # noqa: BLE001 - as above
            return substituted(values)

    return printed


def _source_name(source: Any) -> str:
    name = getattr(source, "name", "")
    return name() if callable(name) else str(name)
