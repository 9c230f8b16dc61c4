"""Every private torch API piecewise touches, in one place, so a torch upgrade touches one file.

Checked on torch 2.11 (CUDA) and 2.13 (CPU).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._dynamo

# Dynamo's "graph break under fullgraph" exception.
Unsupported = torch._dynamo.exc.Unsupported
# What fullgraph=True raises where a graph break would do: unsupported code, and a guard on a data-dependent
# value (``if t.numel() > 0`` after ``torch.where``) that Dynamo reports as a UserError.
UNTRACEABLE = (Unsupported, torch._dynamo.exc.UserError)
# Dynamo's hard failure once a fullgraph frame was compiled recompile_limit times (its guards kept failing).
RECOMPILE_LIMIT = tuple(cls for cls in (getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None),
                                        getattr(torch._dynamo.exc, "RecompileLimitExceeded", None)) if cls)
# Dynamo wraps anything a backend raises in this; ``inner_exception`` holds the original.
BackendCompilerFailed = torch._dynamo.exc.BackendCompilerFailed

try:  # raised when a dimension marked dynamic gets specialised during tracing
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError
except ImportError:  # pragma: no cover - very old torch
    ConstraintViolationError = RuntimeError  # type: ignore[misc,assignment]


@contextlib.contextmanager
def tracing_patches() -> Iterator[None]:
    """Config for the one trace: sizes 0/1 are not specialised, so size 1 reuses the trace made at size N."""
    import torch.fx.experimental._config as fx_config

    with contextlib.ExitStack() as stack:
        if hasattr(fx_config, "backed_size_oblivious"):
            stack.enter_context(fx_config.patch(backed_size_oblivious=True))
        yield


def mark_token_dim(tensor: torch.Tensor, dim: int) -> None:
    torch._dynamo.mark_dynamic(tensor, dim)


def soften_token_dims(tensor: torch.Tensor) -> None:
    """Turn ``mark_dynamic`` dimensions into ``maybe_mark_dynamic`` ones. With graph breaks, code after a break
    may tie a token argument's length to a size Dynamo keeps static there (a tensor Python made); a hard mark
    then fails the trace with ConstraintViolationError, a soft one lets Dynamo trace that stretch per size."""
    dims = getattr(tensor, "_dynamo_dynamic_indices", None)
    if dims:
        del tensor._dynamo_dynamic_indices
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def fake_mode_of(example_inputs: list[Any]):
    """The fake mode Dynamo traced with (from the active tracing context)."""
    return torch._guards.detect_fake_mode(example_inputs)


def is_plain_symbol(value: Any) -> bool:
    """True for a SymInt that is one free symbol (a dynamic input dimension), not an expression."""
    if not isinstance(value, torch.SymInt):
        return False
    expr = value.node.expr
    return bool(getattr(expr, "is_Symbol", False))


def fresh_method(method: types.MethodType) -> types.MethodType:
    """A copy of a bound method with its own code object.

    Dynamo caches compiled frames on the code object; a private copy keeps each compiled model's cache
    apart (no recompile-limit fallbacks when many models of one class are compiled, no cross-talk).
    """
    function = getattr(method, "__func__", None)
    if not isinstance(function, types.FunctionType):
        return method
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__module__ = function.__module__
    copy.__wrapped__ = function
    return types.MethodType(copy, method.__self__)


def compiled_entry(code: types.CodeType) -> tuple[types.CodeType, Callable[[dict], bool]] | None:
    """Dynamo's one compiled entry for ``code``: (transformed bytecode, guard check), or None.

    None when there is not exactly one entry, or this torch does not expose them.
    """
    get = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if get is None:
        return None
    entries = get(code)
    if len(entries) != 1:
        return None
    entry = entries[0]
    manager = getattr(entry, "guard_manager", None)
    check = getattr(manager, "check", None)
    transformed = getattr(entry, "code", None)
    if check is None or not isinstance(transformed, types.CodeType):
        return None
    return transformed, check


def non_owning_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``tensor``'s memory without keeping it allocated (CUDA graph outputs).

    Lets the shared graph pool reuse the memory for other capture sizes, as CUDA graph trees do; the
    alias stays valid because replay writes the same address in the same order as capture did.
    """
    storage = torch._C._construct_storage_from_data_pointer(
        tensor.untyped_storage().data_ptr(), tensor.device, tensor.untyped_storage().nbytes()
    )
    alias = torch.empty((), dtype=tensor.dtype, device=tensor.device)
    alias.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())
    return alias


def storage_alias(base: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``base`` as a tensor that shares its storage but is not a view.

    Dynamo guards views differently from plain tensors; inputs handed to the compiled forward must look
    the same whether they come from a static buffer (padded calls) or from the user (calls above the
    largest capture size), or the second kind would trigger a retrace.
    """
    alias = torch.empty((), dtype=base.dtype, device=base.device)
    alias.set_(base.untyped_storage(), base.storage_offset(), (rows, *base.shape[1:]), base.stride())
    return alias


def compile_with_inductor(graph: torch.fx.GraphModule, example_inputs: list[Any]):
    """Inductor-compile one piece for the symbolic token dimension (called inside the Dynamo backend)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(graph, example_inputs)


def graph_pool_bytes(pool: Any) -> int | None:
    """Bytes reserved by the CUDA graph memory pool ``pool`` (None if the allocator cannot say)."""
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:  # pragma: no cover - allocator without snapshots
        return None
    wanted = tuple(pool) if isinstance(pool, (tuple, list)) else pool
    total = 0
    for segment in segments:
        pool_id = segment.get("segment_pool_id")
        if pool_id is not None and tuple(pool_id) == wanted:
            total += int(segment.get("total_size", 0))
    return total


# Guards on the module tree's structure and tensors (names under ``self``): the types of submodules and of
# their dicts, which parameters exist (``_parameters['bias'] is None``), which objects are shared, hook dicts,
# parameter tensors. Values of plain attributes (EQUALS_MATCH / CONSTANT_MATCH on ``self.eps``) are kept.
_MODULE_STATE_GUARDS = (
    "TENSOR_MATCH", "EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "ID_MATCH", "TYPE_MATCH",
    "DUPLICATE_INPUT", "DICT_KEYS_MATCH",
)
_MODULE_SLOTS = ("._parameters[", "._buffers[")


def drop_shape_guards(entries: list[Any]) -> list[bool]:
    """Dynamo guard filter, applied to the one trace.

    Dropped: the shape-env guard (one trace serves every token count; conditions the forward itself
    evaluates are checked against every capture size when the graph is built, see
    ``token_guard_failures``, while inductor's own assumptions such as ``2 <= s0`` don't change results),
    and guards on the module's own structure and tensors (``_MODULE_STATE_GUARDS``): captured graphs read
    parameters by address anyway, and these are ~90% of the guards (~1400 of ~1500 on the 16-layer decode
    model), checked on every call. Kept: guards on forward arguments, closure variables, globals, global
    state, and the values of the module's plain attributes (a changed ``self.eps`` still retraces).
    """
    keep = []
    for entry in entries:
        guard_type = getattr(entry, "guard_type", None)
        name = getattr(entry, "name", "")
        own = name == "self" or name.startswith(("self.", "self[", "L['self']"))
        module_state = own and (
            guard_type in _MODULE_STATE_GUARDS
            or (guard_type == "CONSTANT_MATCH" and any(slot in name for slot in _MODULE_SLOTS))
        )
        keep.append(guard_type != "SHAPE_ENV" and not module_state)
    return keep


def keep_shape_guards(entries: list[Any]) -> list[bool]:
    """``drop_shape_guards`` less the shape-env part, for traces with graph breaks: code after a break is traced
    per shape by Dynamo itself (sizes there are symbolic or not), so its shape conditions stay guards."""
    return [keep or getattr(entry, "guard_type", None) == "SHAPE_ENV"
            for keep, entry in zip(drop_shape_guards(entries), entries)]


def compile_options(graph_breaks: bool = False) -> dict[str, Any]:
    return {"guard_filter_fn": keep_shape_guards if graph_breaks else drop_shape_guards}


def _full_paths(where: str) -> str:
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
    failures = []
    for guard in getattr(shape_env, "guards", []):
        expr = guard.expr
        symbols = list(getattr(expr, "free_symbols", ()))
        if not symbols:
            continue
        for size in sizes:
            try:
                holds = bool(expr.subs({symbol: size for symbol in symbols}))
            except TypeError:
                continue
            if not holds:
                sloc = getattr(guard, "sloc", None)
                where = getattr(sloc, "maybe_user_loc", None) or str(sloc or "unknown location")
                failures.append((str(expr), _full_paths(where), size))
    return failures


def argument_source(placeholder: Any) -> str:
    """What a Dynamo graph placeholder stands for, as the user wrote it (``L['store']`` → ``argument 'store'``)."""
    grapharg = placeholder.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    name = getattr(source, "name", None)
    name = name() if callable(name) else name  # a method or a property, by torch version
    match = re.fullmatch(r"L\['(\w+)'\](.*)", name) if isinstance(name, str) else None
    if match and not match.group(2):
        return f"argument {match.group(1)!r}"
    if match:  # L['self']._modules['mlp']._buffers['steps'] → self.mlp.steps
        path = re.sub(r"\._(?:modules|parameters|buffers)\['(\w+)'\]", r".\1", match.group(2))
        return f"`{match.group(1)}{path}`"
    if name is None:  # no source recorded (graphs from torch._dynamo.explain): Dynamo's placeholder name
        own = re.fullmatch(r"l_self_((?:modules|parameters|buffers)_\w+)_", placeholder.name)
        if own:  # l_self_modules_mlp_buffers_steps_ → self.mlp.steps
            return "`self" + re.sub(r"(?:^|_)(?:modules|parameters|buffers)_", ".", own.group(1)) + "`"
    return f"`{name or placeholder.name}`"


def guard_failures(method: Any) -> list:
    """The guards of ``method``'s compiled frames that failed so far, as Dynamo records them, oldest first."""
    code = getattr(getattr(method, "__func__", method), "__code__", None)
    return list(getattr(torch._dynamo.utils, "guard_failures", {}).get(code, ()))


def last_guard_failure(method: Any) -> tuple[str, tuple[str, int, str] | None] | None:
    """The guard of ``method``'s compiled frame that failed last: its code (then the model line it came from, as
    Dynamo abbreviates it) on one line, and the innermost model frame of its stack (file, line, function); None
    where Dynamo keeps no record."""
    failures = guard_failures(method)
    if not failures:
        return None
    guard, _, stack = str(failures[-1]).partition("\nUser stack trace")
    frames = re.findall(r'File "(.+?)", line (\d+), in (\S+)', stack)
    frame = (frames[-1][0], int(frames[-1][1]), frames[-1][2]) if frames else None
    return " ".join(re.sub(r"^\d+/\d+: ", "", guard).split()), frame
