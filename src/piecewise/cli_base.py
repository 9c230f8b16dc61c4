"""What every ``piecewise`` subcommand shares: exit codes, usage errors, loading a ``file.py:factory`` target, the
console, registering a subcommand."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
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
    make_inputs: Callable | None = None
    """``<factory>_inputs(num_tokens)`` beside the factory, when the file defines one (``piecewise verify``)."""


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


def _folder_on_path(path: str) -> None:
    """The target file's folder first on the import path, as ``python path/to/file.py`` has it, for the rest of
    the command: the file may import the modules beside it, when it loads and later (a fix names them by the
    import the file wrote)."""
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _load_module(path: str) -> Any:
    if not path.endswith(".py") and not os.path.exists(path) and re.fullmatch(r"[\w.]+", path):
        try:  # a dotted module name, e.g. piecewise.models.llama
            return importlib.import_module(path)
        except ImportError as exc:
            raise UsageError(f"cannot import module {path!r}: {exc}; give path/to/file.py or an importable module") from exc
    if not os.path.isfile(path):
        raise UsageError(f"target file {path!r} does not exist (looked in {os.getcwd()}); check the path")
    name = _module_name(path)
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot load {path!r} as Python source; the target must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    _folder_on_path(path)
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
        frames = traceback.extract_tb(exc.__traceback__)
        source = os.path.realpath(getattr(module, "__file__", None) or path)  # the factory's file: its line
        frame = next((f for f in reversed(frames) if os.path.realpath(f.filename) == source), frames[-1])
        raise UsageError(f"{path}:{factory_name}() raised {detail} at {frame.filename}:{frame.lineno} "
                         f"(`{(frame.line or '').strip()}`)") from exc
    found = _check_result(result, f"{path}:{factory_name}()")
    make_inputs = getattr(module, f"{factory_name}_inputs", None)
    found.make_inputs = make_inputs if callable(make_inputs) else None
    return found


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

def _console():
    """A rich console for stdout; piped, it does not wrap lines (file paths stay whole)."""
    from rich.console import Console

    return Console(soft_wrap=not sys.stdout.isatty())


def _subcommand(subparsers: argparse._SubParsersAction, name: str, handler, summary: str, description: str):
    """Register subcommand ``name`` (``summary`` in ``piecewise --help``) run by ``handler(options)``."""
    parser = subparsers.add_parser(name, help=summary, description=description)
    parser.set_defaults(handler=handler)
    return parser


def output_path(path: str | None, flag: str) -> str | None:
    """``path`` for an output file, checked before any work: its folder must exist."""
    folder = os.path.dirname(os.path.abspath(path)) if path else None
    if folder is not None and not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: the folder {folder} does not exist; create it or give another path")
    return path


def non_negative_int(text: str) -> int:
    """argparse type: an int of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
