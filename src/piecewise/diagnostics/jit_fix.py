"""The tailored fix for ``jit_subprocess``: name the function to make opaque as the user can write it.

The function is the outermost frame outside the model's own files: a library's entry point (``flashinfer.fp4_quantize``)
or a method of the user's own classes (``CheckedNorm.forward``). It is named by the path ``import`` reaches it by,
or, for a file loaded by path (``piecewise doctor file.py:factory``, ``__main__``), by its qualified name and its
file: never by a module name that exists only inside this process.
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback
from typing import Any

from piecewise.diagnostics.classify import FIXES, is_stdlib, is_torch_internal, real_path


def _package_root(path: str) -> str:
    """Top-most package directory holding ``path`` (the file itself when it is not in a package)."""
    directory = os.path.dirname(real_path(path))
    if not os.path.exists(os.path.join(directory, "__init__.py")):
        return real_path(path)
    while os.path.exists(os.path.join(os.path.dirname(directory), "__init__.py")):
        directory = os.path.dirname(directory)
    return directory + os.sep


def library_entry(frames: list[traceback.FrameSummary], root_file: str) -> int | None:
    """Index of the outermost frame outside the model's own file/package and outside the stdlib."""
    root = _package_root(root_file)
    for index, frame in enumerate(frames):
        real = real_path(frame.filename)
        inside_model = real == root if not root.endswith(os.sep) else real.startswith(root)
        if not inside_model and not is_stdlib(frame.filename) and not is_torch_internal(frame.filename):
            return index
    return None


def _importable(name: str) -> bool:
    """Whether ``import name`` finds a module by that name (asking the finders, not ``sys.modules``)."""
    top = name.partition(".")[0]
    return any(getattr(finder, "find_spec", None) and finder.find_spec(top, None) for finder in sys.meta_path)


def _modules_of(path: str) -> list[tuple[str, Any]]:
    """The loaded modules of file ``path``, by name, importable names first."""
    real = real_path(path)
    found = [(name, module) for name, module in list(sys.modules.items())
             if getattr(module, "__file__", None) and real_path(module.__file__) == real]
    return sorted(found, key=lambda item: not _importable(item[0]))


def _function_at(module: Any, frame: traceback.FrameSummary) -> Any:
    """The module's function or class method (defined in its file) whose code holds the frame, or None."""
    candidates = []
    for value in vars(module).values():
        if inspect.isclass(value) and value.__module__ == module.__name__:
            candidates.extend(vars(value).values())
        else:
            candidates.append(value)
    found = None
    for candidate in candidates:
        function = inspect.unwrap(getattr(candidate, "__func__", candidate)) if callable(candidate) else None
        code = getattr(function, "__code__", None)
        if code is None or code.co_name != frame.name or real_path(code.co_filename) != real_path(frame.filename):
            continue
        if code.co_firstlineno <= (frame.lineno or 0) and (found is None or code.co_firstlineno > found[0]):
            found = (code.co_firstlineno, function)
    return found[1] if found else None


def _named(frame: traceback.FrameSummary) -> tuple[str, Any, str]:
    """How a fix names the frame's function: (the name to write, the function or None, where it is defined)."""
    shown = os.path.relpath(frame.filename) if real_path(frame.filename).startswith(os.getcwd() + os.sep) \
        else frame.filename
    for name, module in _modules_of(frame.filename):
        function = _function_at(module, frame)
        if function is None:
            continue
        qualname = function.__qualname__
        if not _importable(name) or "." in qualname:
            return qualname, function, f" (in {shown})"
        parts = name.split(".")  # the shortest package path that names the same object
        prefix = next((".".join(parts[:depth]) for depth in range(1, len(parts) + 1)
                       if getattr(sys.modules.get(".".join(parts[:depth])), qualname, None) is function), name)
        return f"{prefix}.{qualname}", function, ""
    return frame.name, None, f" (in {shown})"


def jit_fix(frames: list[traceback.FrameSummary], root_file: str | None) -> str:
    """The remedy for ``jit_subprocess``, naming the library entry point to wrap."""
    entry = library_entry(frames, root_file or (frames[0].filename if frames else ""))
    if entry is None:
        return FIXES["unsupported_builtin"].replace("Dynamo cannot trace this call", "Dynamo cannot trace "
                                                    "host-process calls (subprocess, locks, file I/O)")
    frame = frames[entry]
    name, function, defined = _named(frame)
    try:
        parameters = list(inspect.signature(function).parameters) if function is not None else ["*args"]
    except (TypeError, ValueError):
        parameters = ["*args"]
    what = (f"`{name}`{defined} runs host-side setup on first use (a subprocess, lock or file I/O: e.g. a JIT build "
            f"or a toolkit version check) that Dynamo cannot trace")
    if parameters[:1] == ["self"]:  # a method: an opaque op takes tensors, not the module
        owner = name.rpartition(".")[0]
        return (f"{what}, at line {frame.lineno}. An opaque op takes tensors, not the module the method belongs to: "
                f"run the setup once outside forward (e.g. in `{owner}.__init__`, or before piecewise.compile), or "
                f"move it with the tensor work that needs it into a function of tensors and make that an opaque op "
                f"called from the method:\n"
                f"    fn = piecewise.wrap_opaque(fn, fake=lambda x: ...)\n"
                f"CaptureConfig(frontend='breakable') runs the method as written.")
    call_site = frames[entry - 1] if entry > 0 else None
    where = f" (the call at {call_site.filename}:{call_site.lineno})" if call_site else ""
    short = name.rpartition(".")[2]
    return (
        f"{what}. Make it an opaque op so tracing records one call and never enters it, and call the wrapper from "
        f"forward{where}:\n"
        f"    {short} = piecewise.wrap_opaque({name}, fake=lambda {', '.join(parameters)}: ...)\n"
        f"The fake returns empty tensors with the output shapes and dtypes; piecewise's eager warm-up makes "
        f"the first (building) call outside tracing."
    )
