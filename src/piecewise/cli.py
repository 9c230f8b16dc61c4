"""The ``piecewise`` command line.

    piecewise doctor path/to/file.py:factory [--json]

``factory()`` returns ``(model, args)`` or ``(model, args, kwargs)``. Exit status: 0 capture-safe,
1 blockers found (the report says which and how to fix them), 2 usage errors.

Each subcommand is one ``add_<name>(subparsers)`` function that registers its parser and sets
``handler``; ``main`` dispatches on it. Add a subcommand by writing one such function and listing it in
``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_BLOCKED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """A problem with what the user asked for; the message says what was wrong and what to do."""


@dataclass
class Target:
    """What a ``file.py:factory`` target produced: the model and its example inputs."""

    model: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)


# --- loading targets -----------------------------------------------------------------------------------

def _split_target(target: str) -> tuple[str, str]:
    path, sep, factory = target.rpartition(":")
    if not sep or not path or not factory:
        raise UsageError(
            f"target {target!r} is not PATH:FACTORY; write it as path/to/file.py:factory, where factory() "
            f"returns (model, args) or (model, args, kwargs)"
        )
    if not factory.isidentifier():
        raise UsageError(f"factory name {factory!r} in target {target!r} is not a Python identifier")
    return path, factory


def _module_name(path: str) -> str:
    stem = os.path.splitext(os.path.basename(path))[0]
    name = re.sub(r"\W", "_", stem)
    return f"piecewise_target_{name}"


def _load_module(path: str) -> Any:
    if not os.path.isfile(path):
        raise UsageError(f"target file {path!r} does not exist (looked in {os.getcwd()}); check the path")
    name = _module_name(path)
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot load {path!r} as Python source; the target must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        raise UsageError(f"importing {path!r} failed: {detail}; fix the file so it imports") from exc
    return module


def load_target(target: str) -> Target:
    """Import ``path/to/file.py`` (by path) and call its factory; check what it returned."""
    path, factory_name = _split_target(target)
    module = _load_module(path)
    factory = getattr(module, factory_name, None)
    if factory is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UsageError(
            f"{path!r} has no function {factory_name!r}; define it, or pick one of: {', '.join(public) or 'none'}"
        )
    if not callable(factory):
        raise UsageError(f"{path}:{factory_name} is not a function (it is of type {type(factory).__name__})")
    try:
        result = factory()
    except Exception as exc:
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        raise UsageError(f"{path}:{factory_name}() raised {detail}") from exc
    return _check_result(result, f"{path}:{factory_name}()")


def _check_result(result: Any, where: str) -> Target:
    expected = "(model, args) or (model, args, kwargs), with args a tuple and kwargs a dict"
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise UsageError(f"{where} returned {type(result).__name__}; it must return {expected}")
    model, args = result[0], result[1]
    kwargs = result[2] if len(result) == 3 else {}
    if not callable(model):
        raise UsageError(f"{where} returned a {type(model).__name__} as the model; it must be an nn.Module")
    if not isinstance(args, (tuple, list)):
        raise UsageError(
            f"{where} returned args of type {type(args).__name__}; wrap the inputs in a tuple, e.g. (x,)"
        )
    if not isinstance(kwargs, dict):
        raise UsageError(f"{where} returned kwargs of type {type(kwargs).__name__}; it must be a dict")
    return Target(model=model, args=tuple(args), kwargs=dict(kwargs))


# --- subcommands ---------------------------------------------------------------------------------------

def add_doctor(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="list everything that stops a model from being captured, with fixes",
        description="Run the model once eagerly, trace its forward with Dynamo and report every capture "
        "blocker (kind, call chain, fix). Exit 0 when capture-safe, 1 when blockers were found.",
    )
    parser.add_argument("target", help="path/to/file.py:factory; factory() returns (model, args[, kwargs])")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=run_doctor)


def run_doctor(options: argparse.Namespace) -> int:
    from piecewise.diagnostics import doctor

    target = load_target(options.target)
    if options.json:  # keep stdout pure JSON even if the model prints
        with contextlib.redirect_stdout(sys.stderr):
            report = doctor(target.model, *target.args, **target.kwargs)
    else:
        report = doctor(target.model, *target.args, **target.kwargs)
    if options.json:
        print(report.to_json())
    else:
        from rich.console import Console

        report.render(Console())
    return EXIT_OK if report.ok else EXIT_BLOCKED


# `piecewise run TARGET` (the runtime's entry point) is added here as `add_run`, then listed below.

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_doctor]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="piecewise", description="Piecewise CUDA graphs for PyTorch inference.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``piecewise`` console script; returns the exit status."""
    parser = build_parser()
    try:
        options = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help (0) and on bad arguments (2)
        return int(exit_.code or 0)
    try:
        return options.handler(options)
    except UsageError as exc:
        print(f"piecewise {options.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
