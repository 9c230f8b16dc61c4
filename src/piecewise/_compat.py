"""Every private torch API piecewise touches, in one place, so a torch upgrade touches one file.

Checked on torch 2.11 (CUDA) and 2.13 (CPU).
"""

from __future__ import annotations

import contextlib
import re
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
TRACE_ERROR = (torch._dynamo.exc.TorchRuntimeError,)
"""Dynamo failing to run the forward's ops on fake tensors (a shape that does not follow the symbolic token count)."""

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


def _backed(symbol: Any) -> bool:
    """A symbol of an input's size (``s0``), not one of a data-dependent size (``u0``: ``nonzero``, masks)."""
    try:
        from torch.utils._sympy.symbol import SymT, symbol_is_type

        return not symbol_is_type(symbol, SymT.UNBACKED_INT)
    except ImportError:  # pragma: no cover - older torch
        return not str(symbol).startswith("u")


def is_plain_symbol(value: Any) -> bool:
    """True for a SymInt that is one free symbol of an input's size (a dynamic input dimension: the token count),
    not an expression, nor a data-dependent size."""
    if not isinstance(value, torch.SymInt):
        return False
    expr = value.node.expr
    return bool(getattr(expr, "is_Symbol", False)) and _backed(expr)


def data_dependent(tensor: torch.Tensor) -> bool:
    """Whether a (fake) tensor's shape holds a data-dependent size (``nonzero``, boolean indexing)."""
    return any(isinstance(extent, torch.SymInt) and not all(_backed(s) for s in extent.node.expr.free_symbols)
               for extent in tensor.shape)


def symbolic(value: Any) -> bool:
    """True for a SymInt whose value is computed from input sizes (the token count, or an expression of it)."""
    if not isinstance(value, torch.SymInt):
        return False
    symbols = value.node.expr.free_symbols
    return bool(symbols) and all(_backed(symbol) for symbol in symbols)


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


def failed_guard(check: Callable[[dict], bool], frame_locals: dict) -> str | None:
    """The first guard of a compiled entry's check (``compiled_entry``) that ``frame_locals`` fail, on one line
    (``L['meta'].max_len == 5, model.py:12 in forward``: the guard, then where the model read it); None where this
    torch does not say."""
    verbose = getattr(getattr(check, "__self__", None), "check_verbose", None)
    try:
        parts = getattr(verbose(frame_locals), "verbose_code_parts", None) if verbose else None
    except Exception:  # noqa: BLE001 - a torch whose verbose check wants more than the frame's locals
        return None
    if not parts:
        return None
    guard, *notes = (" ".join(part.split()) for part in str(parts[0]).split("#"))
    where = next((note for note in reversed(notes) if note), "")
    return f"{guard}, {where}" if where else guard


@contextlib.contextmanager
def conds_as_branches() -> Iterator[None]:
    """``torch.cond`` as the Python ``if`` it stands for, while the breakable front-end runs the forward under its
    dispatch mode: torch's eager ``cond`` compiles itself with Dynamo, which no dispatch mode of ours may enter (and
    after a failure there torch's later eager ``cond`` calls fail too). The predicate then reaches the host as a
    Python ``if`` on a tensor does, and the branch's ops run as the forward's own."""
    original = torch.cond

    def cond(pred, true_fn, false_fn, operands=(), *args, **kwargs):
        return (true_fn if bool(pred) else false_fn)(*operands)

    torch.cond = cond
    try:
        yield
    finally:
        torch.cond = original


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


def compile_with_inductor(graph: torch.fx.GraphModule, example_inputs: list[Any]):
    """Inductor-compile one piece for the symbolic token dimension (called inside the Dynamo backend)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(graph, example_inputs)


# Guards on the module tree's tensors (names under ``self``): parameter and buffer tensors and their slots
# (``_parameters['bias']``), tied-tensor identity, dict keys. Captured graphs read parameters by address anyway, and
# ``ParameterWatch`` turns a replaced, moved or removed parameter or buffer into an error. Kept: the types and
# identities of submodules and of plain attributes (a swapped quantization method object, an enum, a replaced
# parameterless submodule), attributes set on an instance (a patched ``forward``), hook dicts (a hook registered
# later) and the values of plain attributes (``self.eps``): a change retraces.
_MODULE_TENSOR_GUARDS = ("TENSOR_MATCH", "DUPLICATE_INPUT", "DICT_KEYS_MATCH")
_MODULE_SLOTS = ("._parameters[", "._buffers[")


def drop_shape_guards(entries: list[Any]) -> list[bool]:
    """Dynamo guard filter, applied to the one trace.

    Dropped: the shape-env guard (one trace serves every token count; conditions the forward itself
    evaluates are checked against every capture size when the graph is built, see
    ``token_guard_failures``, while inductor's own assumptions such as ``2 <= s0`` don't change results),
    and guards on the module's own tensors (``_MODULE_TENSOR_GUARDS``, anything in a parameter or buffer slot),
    which ``ParameterWatch`` checks once per change instead of on every call (about a tenth of the guards, which
    cost half the check). Kept: guards on forward arguments, closure variables, globals, global state, and the
    module tree's structure and plain attributes (types, identities, instance attributes, hooks, values).
    """
    keep = []
    for entry in entries:
        guard_type = getattr(entry, "guard_type", None)
        name = getattr(entry, "name", "")
        own = name == "self" or name.startswith(("self.", "self[", "L['self']"))
        tensors = own and (guard_type in _MODULE_TENSOR_GUARDS or any(slot in name for slot in _MODULE_SLOTS))
        keep.append(guard_type != "SHAPE_ENV" and not tensors)
    return keep


def compile_options(graph_breaks: bool = False) -> dict[str, Any]:
    """The one trace: ``drop_shape_guards``. With graph breaks every guard stays: code after a break is traced per
    shape by Dynamo itself, and a layer's frame is compiled on code every instance of its class shares, so the
    guards on the module (its submodules' types, its tensors) tell one layer's trace from another's."""
    return {} if graph_breaks else {"guard_filter_fn": drop_shape_guards}


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


# --- side streams forked while a graph captures ------------------------------------------------------------------
# A forward may fork a side stream from the capturing stream (``side.wait_stream(current)``, or an event recorded
# on it that ``side`` waits for) and join it after the next graph boundary (a splitting op): the capture cannot
# end with the fork open. While piecewise captures, hooks on ``torch.cuda.Stream.wait_event`` and
# ``torch.cuda.Event.record`` note each fork for the graph's end to join, as SGLang does; a later join of such a
# stream is then a no-op.
_fork_sinks: dict[int, list] = {}
"""Capturing stream's handle → the streams forked from it since its graph began."""
_joined: set[int] = set()
"""Handles of side streams a graph's end joined."""
_stream_originals: dict[str, Any] = {}


def _hooked_record(self, stream=None):
    if stream is None:
        stream = torch.cuda.current_stream()
    try:
        self._piecewise_stream = stream.cuda_stream
    except AttributeError:  # an event type without a __dict__: not tracked
        pass
    return _stream_originals["record"](self, stream)


def _hooked_wait_event(self, event):
    source = getattr(event, "_piecewise_stream", None)
    if source is not None and source != self.cuda_stream:
        forks = _fork_sinks.get(source)
        if forks is not None:  # a fork from a capturing stream
            forks.append(self)
            _joined.discard(self.cuda_stream)
        elif self.cuda_stream in _fork_sinks and source in _joined:
            return None  # a late join of a stream already joined at a graph's end
    return _stream_originals["wait_event"](self, event)


@contextlib.contextmanager
def tracking_stream_forks() -> Iterator[None]:
    """Note side streams forked from capturing streams while the block runs (see ``_fork_sinks``)."""
    if _stream_originals:  # already tracking (a nested session)
        yield
        return
    _stream_originals.update(record=torch.cuda.Event.record, wait_event=torch.cuda.Stream.wait_event)
    torch.cuda.Event.record = _hooked_record
    torch.cuda.Stream.wait_event = _hooked_wait_event
    try:
        yield
    finally:
        torch.cuda.Event.record = _stream_originals["record"]
        torch.cuda.Stream.wait_event = _stream_originals["wait_event"]
        _stream_originals.clear()
        _fork_sinks.clear()
        _joined.clear()


def watch_forks(stream: Any) -> None:
    """Start noting the streams forked from ``stream`` (which has just begun capturing)."""
    _fork_sinks[stream.cuda_stream] = []


def join_forks(stream: Any) -> int:
    """Make ``stream`` wait for every stream forked from it since ``watch_forks``; returns how many."""
    forks = _fork_sinks.pop(stream.cuda_stream, [])
    seen: set[int] = set()
    for side in forks:
        if side.cuda_stream not in seen:
            seen.add(side.cuda_stream)
            stream.wait_stream(side)
            _joined.add(side.cuda_stream)
    return len(seen)


# nn.Module's own entries in a module's __dict__: what is left are the attributes its code set.
MODULE_BOOKKEEPING = frozenset({
    "training", "_parameters", "_buffers", "_non_persistent_buffers_set", "_modules", "_backward_pre_hooks",
    "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_compiled_call_impl",
})


# --- module attributes assigned -----------------------------------------------------------------------------------
_assignment_callbacks: list = []  # weakref.WeakMethod of each callback
_MODULE_SETATTR = torch.nn.Module.__setattr__  # as torch defines it


def _watched_setattr(self, name, value):
    if torch.compiler.is_compiling():  # first: Dynamo, tracing a forward's assignment, reads nothing of ours
        return _MODULE_SETATTR(self, name, value)
    _MODULE_SETATTR(self, name, value)
    if _assignment_callbacks:
        for reference in list(_assignment_callbacks):
            callback = reference()
            if callback is None:
                _assignment_callbacks.remove(reference)
            else:
                callback(self, name)


def on_module_assignment(callback: Callable[[torch.nn.Module, str], None]) -> None:
    """Call the bound method ``callback(module, name)`` after each attribute assignment of any module (torch has
    registration hooks for parameters, buffers and submodules only); it is dropped with its object. Wraps
    ``nn.Module.__setattr__`` once; an assignment costs one list check while nothing listens."""
    import weakref

    if torch.nn.Module.__setattr__ is not _watched_setattr:
        torch.nn.Module.__setattr__ = _watched_setattr
    _assignment_callbacks.append(weakref.WeakMethod(callback))


# --- global state a captured graph depends on --------------------------------------------------------------------
def global_state_guard() -> Any:
    """A snapshot of the global state a graph's kernels depend on (autocast, default dtype, TF32 and reduced-precision
    reductions, deterministic algorithms, grad mode, torch-function state, threads): ``check()`` is True while it holds,
    ``reason()`` names what changed. Dynamo's own global-state guard (0.3 µs a check)."""
    return torch._C._dynamo.guards.GlobalStateGuard()


BENIGN_GLOBAL_STATE = frozenset({"num_threads"})  # parts of the global state that change no graph's numbers


class Addresses:
    """The data pointers of some tensors, all checked in one C++ call on CUDA builds (CUDA graph trees' check of
    their static inputs). A build without CUDA has no graph to read an old address, and a traced piece takes the
    parameters it reads as inputs on every call: there the first tensor is checked, which ``model.to()`` and
    ``.half()`` move with the rest."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.pointers = [tensor.data_ptr() for tensor in tensors]
        self.indices = list(range(len(tensors)))
        self.check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)

    def unchanged(self) -> bool:
        if self.check is not None:
            return self.check(self.tensors, self.pointers, self.indices)
        return not self.tensors or self.tensors[0].data_ptr() == self.pointers[0]


_NO_CONTEXT = contextlib.nullcontext()


_OWN_MODEL_OPS = ("piecewise_hf::", "piecewise_examples::")


def autocast_off(op: str):
    """Autocast off for the body of one of piecewise's attention and model ops (``op``, its qualified name) where
    any is on: under autocast an SDPA inside would give bfloat16 from float32 inputs, which its fake, from the
    inputs, does not say. Other ops (a user's) keep the caller's autocast, which their bodies may rely on."""
    return torch._C._DisableAutocast() if op.startswith(_OWN_MODEL_OPS) and torch._C._is_any_autocast_enabled() \
        else _NO_CONTEXT
