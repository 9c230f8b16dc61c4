"""Opaque ops: functions Dynamo never traces into.

A function becomes a ``torch.library`` custom op with a fake (meta) implementation, so tracing records one
call node and never runs the body. That is how JIT kernel libraries (a subprocess to ``nvcc``, file locks,
module loads on first use) stay out of the trace. An op made with ``split=True`` is also a splitting op:
the graph is cut at it and it runs eagerly between captured pieces.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from . import _compat
from .errors import FakeMismatch
from .fakes import FakeCheck, contiguous_outputs, fake_mismatch, resolved_signature

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "piecewise_ops"

_lock = threading.Lock()
_splitting_ops: set[str] = set()
_opaque_ops: dict[str, "OpaqueOpInfo"] = {}
_wrapped: dict[Any, Callable] = {}


@dataclass
class OpaqueOpInfo:
    """What piecewise knows of one opaque op."""

    name: str
    split: bool
    eager_calls: int = 0
    """How often the body ran (outside tracing: the body never runs while Dynamo traces)."""
    impl: Callable | None = None
    """The Python body; the runtime calls it directly between pieces, skipping dispatcher overhead."""
    capturable: bool | Callable[[Any], bool] = False
    """Whether the op may run inside a full CUDA graph for a call (see ``opaque_op``)."""
    fake: FakeCheck | None = None
    """The fake against the op's first eager call outside a CUDA graph capture (``fakes.fake_mismatch``)."""
    contiguous: bool = False
    """``fake.contiguous``, read at every call: the op's outputs are made contiguous."""

    def captures(self, ctx: Any) -> bool:
        """Whether the op accepts being captured whole for the call ``ctx`` (a ``ForwardContext``)."""
        return bool(self.capturable(ctx)) if callable(self.capturable) else bool(self.capturable)


def captured_whole(name: str) -> bool:
    """Whether the splitting op ``name`` runs inside the full graph of the call in progress (its
    ``capturable`` for ``piecewise.context()``); an op piecewise did not make never does."""
    from .context import context

    info = opaque_op_info(name)
    return info is not None and info.captures(context())


def opaque_call_counts() -> dict[str, int]:
    """How often each opaque op's body has run (``OpaqueOpInfo.eager_calls``), by name."""
    with _lock:
        return {name: info.eager_calls for name, info in _opaque_ops.items()}


def check_fakes(names: Iterable[str], strides: bool = False) -> None:
    """Raise ``FakeMismatch`` for the first of the opaque ops ``names`` whose fake got its first eager call wrong
    (``strides``: its strides too, which Inductor's pieces assert)."""
    checks = [info.fake for name in sorted(names) if (info := opaque_op_info(name)) and info.fake]
    mismatches = [m for check in checks if (m := check.mismatch or (check.strides if strides else None))]
    if mismatches:
        raise FakeMismatch(mismatches[0])


def splitting_op_names() -> frozenset[str]:
    """Names (``"ns::name"``) of every op registered with ``split=True``."""
    with _lock:
        return frozenset(_splitting_ops)


def resolve_splitting_ops(names: Iterable[str] | None) -> frozenset[str]:
    """The ``"ns::name"`` of each configured splitting op (``CaptureConfig.splitting_ops``; None: every op made
    with ``split=True``). An overload (``"ns::name.default"``) stands for its op, as vLLM accepts; a name no
    registered op has raises ``ValueError`` listing the splitting ops piecewise knows."""
    if names is None:
        return splitting_op_names()
    resolved = []
    for name in names:
        namespace, _, rest = name.partition("::")
        short, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, namespace, None), short, None) if short.isidentifier() else None
        if not isinstance(packet, torch._ops.OpOverloadPacket) or (overload and overload not in packet.overloads()):
            raise ValueError(
                f"CaptureConfig.splitting_ops names {name!r}, which is not a registered op"
                + (f" overload (its overloads: {packet.overloads()})" if isinstance(packet, torch._ops.OpOverloadPacket)
                   else "") + f". Splitting ops made with piecewise.opaque_op(..., split=True): "
                f"{sorted(splitting_op_names())}; any torch.library op can be named as 'ns::name'"
            )
        resolved.append(f"{namespace}::{short}")
    return frozenset(resolved)


def opaque_op_info(name: str) -> OpaqueOpInfo | None:
    return _opaque_ops.get(_qualify(name))


def op_name(target: Any) -> str | None:
    """``"ns::name"`` of an FX node target that is a torch op (overload packet or overload), else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return target._qualified_op_name if isinstance(target, torch._ops.OpOverloadPacket) else None


def _qualify(name: str) -> str:
    return name if "::" in name else f"{DEFAULT_NAMESPACE}::{name}"


def _check_name(name: str) -> str:
    qualified = _qualify(name)
    namespace, _, short = qualified.partition("::")
    for part in (namespace, short):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part):
            raise ValueError(
                f"opaque op name {name!r} is not valid: use 'namespace::name' with identifier characters only"
            )
    return qualified


def _tensors(values: Iterable[Any]):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def _first_tensor(values: Iterable[Any]) -> torch.Tensor | None:
    return next(_tensors(values), None)


def _default_fake(qualified: str, returns: str) -> Callable:
    returns = returns.strip()
    if returns == "()":
        return lambda *args, **kwargs: None
    if returns != "Tensor":
        raise ValueError(
            f"opaque op {qualified!r} returns {returns}; the default fake only covers one tensor like the first "
            f"tensor argument: pass fake=... returning tensors of the right shapes and dtypes"
        )

    def fake(*args, **kwargs):
        like = _first_tensor((*args, *kwargs.values()))
        if like is None:
            raise ValueError(
                f"opaque op {qualified!r} has no tensor argument to model its output on: pass fake=..."
            )
        return torch.empty_like(like)

    return fake


def _register(
    qualified: str,
    impl: Callable,
    *,
    schema: str | None,
    fake: Callable | None,
    mutates_args: Iterable[str] | str,
    split: bool,
    capturable: bool | Callable[[Any], bool] = False,
) -> torch.library.CustomOpDef:
    if qualified in _opaque_ops:
        raise ValueError(
            f"an opaque op named {qualified!r} already exists; pick another name (name=...) or reuse that op"
        )
    info = OpaqueOpInfo(name=qualified, split=split, capturable=capturable)

    def body(*args, **kwargs):
        info.eager_calls += 1  # a counter and two compares: the runtime calls this between pieces on every step
        with _compat.autocast_off(qualified):  # piecewise's own ops: outputs' dtypes follow inputs, as fakes say
            result = impl(*args, **kwargs)
        if info.fake is None and (check := fake_mismatch(qualified, op, args, kwargs, result)) is not None:
            info.fake, info.contiguous = check, check.contiguous
        return contiguous_outputs(result) if info.contiguous else result

    info.impl = body
    body.__signature__, body.__annotations__ = resolved_signature(impl)  # custom_op infers the schema from these
    if isinstance(mutates_args, str):  # one argument's name, or torch's "unknown"
        mutates = mutates_args if mutates_args == "unknown" else (mutates_args,)
    else:
        mutates = tuple(mutates_args)
    parameters = inspect.signature(impl).parameters
    missing = [name for name in ([] if mutates == "unknown" else mutates) if name not in parameters]
    if missing:
        raise ValueError(
            f"cannot make {qualified!r} an opaque op: mutates_args names {missing}, which "
            f"{getattr(impl, '__name__', 'the function')} has no parameter for; its parameters: {list(parameters)}"
        )
    try:
        op = torch.library.custom_op(qualified, body, mutates_args=mutates, schema=schema)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(
            f"cannot make {qualified!r} an opaque op: {exc}. Annotate its parameters and return type "
            f"(torch.Tensor, int, float, bool, str, list[torch.Tensor], optional versions) or pass schema=..."
        ) from exc
    returns = str(op._opoverload._schema).split(" -> ", 1)[1]
    op.register_fake(fake if fake is not None else _default_fake(qualified, returns))
    with _lock:
        _opaque_ops[qualified] = info
        if split:
            _splitting_ops.add(qualified)
    return op


def opaque_op(
    name: str,
    *,
    fake: Callable | None = None,
    mutates_args: Iterable[str] | str = (),
    split: bool = False,
    capturable: bool | Callable[[Any], bool] = False,
) -> Callable[[Callable], torch.library.CustomOpDef]:
    """Decorator: make a type-annotated Python function an opaque ``torch.library`` op.

    ``name`` is ``"namespace::name"`` (a bare name goes to ``piecewise_ops``). ``fake`` computes output metadata
    from fake inputs, strides included (``piecewise.fakes``; default: one tensor like the first tensor argument;
    ops returning nothing need none). ``mutates_args`` names the arguments written in place (one name, or
    several). ``split=True`` makes it a splitting op. ``capturable`` (a bool, or a function of the call's
    ``piecewise.context()``) says that the splitting op may also run inside one CUDA graph of the whole forward
    (``CaptureConfig.graph_mode``): it reads every per-call value from device tensors, picks its kernels from
    shapes only, and, given the padded rows, leaves the state of other rows alone (``piecewise.redirect_padding``
    makes the pad rows repeat the first row's writes). Returns the callable op.
    """
    qualified = _check_name(name)

    def decorate(fn: Callable) -> torch.library.CustomOpDef:
        return _register(qualified, fn, schema=None, fake=fake, mutates_args=mutates_args, split=split,
                         capturable=capturable)

    return decorate


# --- wrapping functions from other libraries ------------------------------------------------------------

_SCALAR_TYPES = ((bool, "bool"), (int, "SymInt"), (float, "float"), (str, "str"))


def _schema_type(value: Any, param: str, fn_name: str) -> str:
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if value is None:
        return "Tensor?"
    for python_type, schema_type in _SCALAR_TYPES:
        if isinstance(value, python_type):
            return schema_type
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return "Tensor[]"
    raise ValueError(
        f"cannot infer the op schema of {fn_name}: argument {param!r} is a {type(value).__name__}; "
        f"pass schema='(Tensor x, ...) -> Tensor' to piecewise.wrap_opaque"
    )


def _return_schema(result: Any, fn_name: str) -> str:
    if result is None:
        return "()"
    if isinstance(result, torch.Tensor):
        return "Tensor"
    if isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
        return "(" + ", ".join("Tensor" for _ in result) + ")"
    raise ValueError(
        f"{fn_name} returned a {type(result).__name__}; opaque ops return a tensor, a tuple of tensors or None"
    )


def _default_literal(value: Any) -> str | None:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value + '"'
    return None


def infer_schema_from_call(fn: Callable, args: tuple, kwargs: dict, result: Any) -> str:
    """Schema string of ``fn`` from one call's arguments and result (for functions without annotations)."""
    fn_name = getattr(fn, "__qualname__", repr(fn))
    signature = inspect.signature(fn)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    parts = []
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(f"cannot infer the op schema of {fn_name}: it takes *args/**kwargs; pass schema=...")
        type_ = _schema_type(bound.arguments[param.name], param.name, fn_name)
        text = f"{type_} {param.name}"
        if param.default is not param.empty:
            literal = _default_literal(param.default)
            if literal is not None:
                text += f"={literal}"
        parts.append(text)
    return "(" + ", ".join(parts) + ") -> " + _return_schema(result, fn_name)


def _derived_name(fn: Callable) -> str:
    module = (getattr(fn, "__module__", None) or "lib").replace(".", "_")
    short = getattr(fn, "__qualname__", getattr(fn, "__name__", "fn")).replace(".", "_").replace("<", "").replace(">", "")
    return f"piecewise_wrapped::{module}__{short}"


def wrap_opaque(
    fn: Callable,
    name: str | None = None,
    *,
    fake: Callable | None = None,
    schema: str | None = None,
    mutates_args: Iterable[str] | str = (),
    split: bool = False,
    capturable: bool | Callable[[Any], bool] = False,
) -> Callable:
    """Wrap a function you don't own (e.g. ``flashinfer.fp4_quantize``) as an opaque op, without touching it.

    The returned callable has ``fn``'s call signature; keyword arguments reach ``fn`` by name. The op schema
    comes from ``schema=``, else from ``fn``'s annotations, else from the first call's arguments: that first
    call must run eagerly (``piecewise.compile`` runs one eager warm-up before tracing, which does this).
    Wrapping the same function twice returns the same wrapper.
    """
    key = (fn, name)
    if key in _wrapped:
        return _wrapped[key]
    qualified = _check_name(name) if name is not None else _derived_name(fn)
    fn_name = getattr(fn, "__qualname__", repr(fn))
    signature = inspect.signature(fn)
    holder: dict[str, Any] = {}

    def define(op_schema: str | None) -> torch.library.CustomOpDef:
        op = _register(qualified, fn, schema=op_schema, fake=fake, mutates_args=mutates_args, split=split,
                       capturable=capturable)
        holder["op"] = op
        return op

    if schema is not None:
        define(_schema_with_names(schema, signature, fn_name))
    else:
        try:
            torch.library.infer_schema(fn, mutates_args=mutates_args if isinstance(mutates_args, str) else tuple(mutates_args))
        except (ValueError, TypeError, RuntimeError):
            pass  # no usable annotations: define on the first (eager) call
        else:
            define(None)

    def wrapper(*args, **kwargs):
        op = holder.get("op")
        if op is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"piecewise.wrap_opaque({fn_name}) has no schema yet and is being traced: call it once "
                    f"eagerly first, or pass schema=..."
                )
            result = fn(*args, **kwargs)
            define(infer_schema_from_call(fn, args, kwargs, result))
            return result
        return op(*args, **kwargs)

    wrapper.__signature__ = signature
    wrapper.__name__ = getattr(fn, "__name__", "wrapped")
    wrapper.__qualname__ = fn_name
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped_op_name__ = qualified
    _wrapped[key] = wrapper
    return wrapper


def _schema_with_names(schema: str, signature: inspect.Signature, fn_name: str) -> str:
    """Accept a schema with or without the leading op name; check its argument names match ``fn``."""
    text = schema.strip()
    if not text.startswith("("):
        text = text[text.index("(") :] if "(" in text else text
    try:
        parsed = torch._C.parse_schema("piecewise_check::op" + text)
    except RuntimeError as exc:
        raise ValueError(f"schema {schema!r} for {fn_name} does not parse: {exc}") from exc
    names = [argument.name for argument in parsed.arguments]
    expected = list(signature.parameters)
    if names != expected:
        raise ValueError(
            f"schema {schema!r} for {fn_name} names arguments {names}, but {fn_name} takes {expected}: "
            f"use the function's own parameter names"
        )
    return text
