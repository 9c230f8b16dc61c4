"""The model's forward arguments: binding, which carry tokens, and the static ones that must stay the same tensors
across calls.

Inside the runtime every token argument carries its tokens in dimension 0. One whose tokens are in another
dimension (gpt-fast's and transformers' ``[batch, tokens]``) is taken with ``movedim(dim, 0)`` (a view) and
handed back to the model in its own layout by ``TokensFirst``."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from ..capture.outputs import walk_tensors
from ..capture.state import STATE_CHANGE
from .guards import NOT_SET, summary, summary_difference
from .layout import inner

logger = logging.getLogger(__name__)


class Arguments:
    """What piecewise knows of the forward's arguments, from its signature and the first call."""

    def __init__(self, model: torch.nn.Module, dynamic: dict[str, int] | None):
        parameters = list(inspect.signature(inner(model).forward).parameters.values())  # a TokensFirst's: the model's
        self.names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not self.names:
            wrapped = getattr(inner(model), "module", None)
            raise ValueError(
                f"piecewise.compile: the forward of {type(inner(model)).__name__} names no argument "
                f"({inspect.signature(inner(model).forward)}): piecewise binds a call's arguments by name to find the "
                f"token arguments. "
                + (f"Compile the module it wraps (model.module, a {type(wrapped).__name__}), or " if isinstance(
                    wrapped, torch.nn.Module) else "Compile ")
                + "a module whose forward names its arguments (a wrapper: def forward(self, input_ids, positions): "
                  "return self.model(input_ids, positions)).")
        dynamic = self._check_dynamic(dynamic)
        self.dynamic = None if dynamic is None else {name: 0 for name in dynamic}
        """Token arguments → 0, their token dimension inside the runtime; decided at the first call when not given."""
        self.moved: dict[str, int] = {} if dynamic is None else {n: d for n, d in dynamic.items() if d != 0}
        """Token arguments whose token dimension in the model's own layout is not 0 → that dimension."""
        self.dynamic_given = dynamic is not None
        self.late: set[str] = set()
        """Tensor arguments first given after the first call (optional state such as a KV cache): a call may
        leave them out again (None), which is another variant of the forward."""
        self.static_ptrs: dict[str, int] = {}
        self.first_shapes: dict[str, tuple[int, ...]] = {}
        self.first_signature: dict[str, Any] | None = None

    def forget_first(self) -> None:
        """After a first call that failed: what it decided by itself is decided again by the next."""
        if not self.dynamic_given:
            self.dynamic, self.moved = None, {}
        self.static_ptrs, self.first_shapes, self.first_signature = {}, {}, None
        self.late.clear()

    def record_first(self, arguments: dict[str, Any]) -> list[torch.Tensor]:
        """Remember the first call's static tensors (returned) and argument shapes."""
        static = []
        for name, value in arguments.items():
            if isinstance(value, torch.Tensor) and name not in self.dynamic:
                self.static_ptrs[name] = value.data_ptr()
                static.append(value)
        self.first_shapes = {n: tuple(v.shape) for n, v in arguments.items() if isinstance(v, torch.Tensor)}
        self.first_signature = self.signature(arguments)
        return static

    def take(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """A call's arguments as the runtime holds them: bound by name, token dimensions first."""
        arguments = self.bind(args, kwargs)
        if self.dynamic is None:
            self.dynamic, self.moved = self._default_dynamic(arguments)
        for name, dim in self.moved.items():
            value = arguments.get(name)
            if isinstance(value, torch.Tensor):
                if not -value.dim() <= dim < value.dim():
                    raise ValueError(f"piecewise: token dimension {dim} of argument {name!r} is out of range for "
                                     f"shape {tuple(value.shape)}")
                arguments[name] = value.movedim(dim, 0)
        return arguments

    def own_layout(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Arguments as the runtime holds them, back in the model's own layout (``take``'s inverse)."""
        return {**arguments, **{name: arguments[name].movedim(0, dim) for name, dim in self.moved.items()
                                if isinstance(arguments.get(name), torch.Tensor)}}

    def user_shape(self, name: str, shape: tuple) -> tuple:
        """A shape as the runtime holds it (tokens first), in the argument's own layout."""
        dim = self.moved.get(name)
        if dim is None:
            return tuple(shape)
        return tuple(torch.empty(shape, device="meta").movedim(0, dim).shape)

    def given_tokens(self, arguments: dict[str, Any]) -> list[str]:
        """The token arguments this call passes (late ones may be left out)."""
        return [name for name in self.dynamic if arguments.get(name) is not None]

    def leading(self, arguments: dict[str, Any], rows: int) -> dict[str, Any]:
        """``arguments`` with each token argument cut to its first ``rows`` rows."""
        return {**arguments, **{name: arguments[name][:rows] for name in self.given_tokens(arguments)}}

    def made(self, arguments: dict[str, Any], rows: int) -> dict[str, Any]:
        """``arguments`` with ``rows`` rows made from the call's: its leading rows, or its rows repeated (the rows
        they write are the call's own)."""
        tokens = self.rows(arguments)
        if rows <= tokens:
            return self.leading(arguments, rows)
        repeat = -(-rows // tokens)
        return {**arguments, **{n: arguments[n].repeat(repeat, *[1] * (arguments[n].dim() - 1))[:rows]
                                for n in self.given_tokens(arguments)}}

    def _check_dynamic(self, dynamic: dict[str, int] | None) -> dict[str, int] | None:
        if dynamic is None:
            return None  # decided at the first call: see _default_dynamic
        if not isinstance(dynamic, dict) or not dynamic:
            raise ValueError(f"piecewise.compile: dynamic must map argument names to token dims, got {dynamic!r}")
        for name, dim in dynamic.items():
            if name not in self.names:
                raise ValueError(
                    f"piecewise.compile: dynamic names {name!r}, which is not a positional-or-keyword argument "
                    f"of forward; forward takes {self.names}"
                )
            if not isinstance(dim, int) or isinstance(dim, bool):
                raise ValueError(f"piecewise.compile: dynamic[{name!r}] must be an int dimension, got {dim!r}")
        return dict(dynamic)

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        if len(args) > len(self.names):
            raise TypeError(f"forward takes {len(self.names)} positional arguments but {len(args)} were given")
        arguments = dict(zip(self.names, args))
        for name, value in kwargs.items():
            if name in arguments:
                raise TypeError(f"forward got multiple values for argument {name!r}")
            arguments[name] = value
        return arguments

    def _default_dynamic(self, arguments: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
        """Dim 0 of the first argument, and of every other 1-D or 2-D tensor argument of the same length
        at the first call (positions, slot mappings). Larger tensors (KV caches) stay static. A first argument of
        token ids shaped [1, n > 1] is one sequence of n tokens, batch-first (gpt-fast's ``idx``, transformers'
        ``input_ids``): its dim 1, with every other [1, n] (dim 1) and [n] (dim 0) tensor argument.
        So is one shaped [b > 1, n] beside a 1-D tensor argument of n rows (gpt-fast's ``input_pos``, transformers'
        ``cache_position``) and no other of b rows: b sequences of n tokens each, the batch static.
        Where the first argument is None (vLLM's ``input_ids`` beside ``inputs_embeds``), the first tensor argument
        leads. Returns (token arguments → 0, those whose own token dimension is 1 → 1)."""
        lead = self.names[0]
        if arguments.get(lead) is None:
            lead = next((name for name in [*self.names, *arguments] if isinstance(arguments.get(name), torch.Tensor)),
                        lead)
        first = arguments.get(lead)
        if _batch_first(first, arguments):
            batch, count = first.shape
            moved = {name: 1 for name, value in arguments.items() if isinstance(value, torch.Tensor)
                     and value.dim() == 2 and tuple(value.shape) == (batch, count)}
            flat = [name for name, value in arguments.items() if isinstance(value, torch.Tensor)
                    and value.dim() == 1 and value.shape[0] == count]
            logger.info("piecewise: token arguments, batch-first ([%d, tokens]): %s", batch, ", ".join([*moved, *flat]))
            return {name: 0 for name in [*moved, *flat]}, moved
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            raise ValueError(
                f"piecewise: the first forward argument {lead!r} carries the tokens by default and must "
                f"be a tensor with a token dimension 0; pass dynamic={{'name': 0, ...}} to name the token arguments"
            )
        chosen = {lead: 0}
        for name, value in arguments.items():
            if name not in chosen and isinstance(value, torch.Tensor) and 1 <= value.dim() <= 2:
                if value.shape[0] == first.shape[0]:
                    chosen[name] = 0
        logger.info("piecewise: token arguments (dim 0): %s", ", ".join(chosen))
        return chosen, {}

    def token_count(self, arguments: dict[str, Any]) -> int:
        if self.dynamic is None:  # decided by take(), which moves the token dimensions first
            raise RuntimeError("piecewise: token_count before take()")
        count = None
        for name, dim in self.dynamic.items():
            value = arguments.get(name)
            if value is None:  # one of several (vLLM's input_ids or inputs_embeds); a late one; another variant
                continue
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"piecewise: token argument {name!r} must be a tensor, got {type(value).__name__}"
                )
            if not -value.dim() <= dim < value.dim():
                raise ValueError(
                    f"piecewise: token dimension {dim} of argument {name!r} is out of range for shape "
                    f"{tuple(value.shape)}"
                )
            rows = value.shape[0]
            if count is not None and rows != count:
                raise ValueError(
                    f"piecewise: token arguments disagree: {name!r} has {rows} tokens, others {count}."
                    + self.taken_note()
                )
            count = rows
        if count is None:
            raise ValueError(f"piecewise: no token argument given: pass at least one of {list(self.dynamic)}")
        if count == 0:
            raise ValueError("piecewise: called with 0 tokens; call with at least one token")
        return count

    def lead_note(self) -> str:
        """Which dimension piecewise took for the tokens by itself and how to name another; '' where the caller
        named them or the first token argument has one dimension."""
        if self.dynamic_given or not self.dynamic:
            return ""
        lead = next(iter(self.dynamic))
        shape = self.user_shape(lead, self.first_shapes.get(lead, ()))
        if len(shape) < 2:
            return ""  # one dimension: nothing else it could have taken
        dim = self.moved.get(lead, 0)
        return (f" piecewise took dimension {dim} of {lead!r} (shape {shape} at the first call) for the tokens by "
                f"itself; if they lie in another dimension, name it: piecewise.compile(model, dynamic={{{lead!r}: "
                f"{1 - dim}, ...}}) with every other token argument's dimension.")

    def taken_note(self) -> str:
        """How piecewise chose the token arguments by itself, and how to name them, where it did; '' where the
        caller named them."""
        if self.dynamic_given or not self.dynamic or len(self.dynamic) < 2:
            return ""
        shapes = ", ".join(f"{name!r} {self.user_shape(name, self.first_shapes[name])}" for name in self.dynamic
                           if name in self.first_shapes)
        lead = next(iter(self.dynamic))
        rows = self.first_shapes.get(lead, (0,))[0]
        return (f" piecewise took the token arguments by themselves at the first call, every tensor argument with "
                f"as many rows as {lead!r} ({rows}{', a one-token call' if rows == 1 else ''}): {shapes}. If some "
                f"of them do not have one row per token (a temperature, a bias, a table), name the token arguments: "
                f"piecewise.compile(model, dynamic={{{', '.join(f'{n!r}: {self.moved.get(n, 0)}' for n in self.dynamic)}}}) "
                f"less those, each with its token dimension" + self._batch_first_alternative()
                + (", or make the first call with more than one token." if rows == 1 else "."))

    def _batch_first_alternative(self) -> str:
        """For token arguments of one row taken tokens-first ([1, 1] ids: one sequence, one token): the naming that
        takes them batch-first ([batch, tokens], gpt-fast's and transformers' layout)."""
        flipped = [n for n in self.dynamic if self.moved.get(n, 0) == 0 and len(self.first_shapes.get(n, ())) == 2
                   and self.first_shapes[n][0] == 1]
        if not flipped:
            return ""
        dims = ", ".join(f"{n!r}: {1 if n in flipped else self.moved.get(n, 0)}" for n in self.dynamic)
        return f" ([batch, tokens] arguments such as gpt-fast's and transformers' ids: dynamic={{{dims}}})"

    def rows(self, arguments: dict[str, Any]) -> int:
        """The tokens of a call's arguments as the runtime holds them (the first token argument given)."""
        return arguments[self.given_tokens(arguments)[0]].shape[0]

    def adopt_late(self, arguments: dict[str, Any], tokens: int) -> list[torch.Tensor]:
        """A tensor first given after the first call (None before) follows the first call's rules: a token
        argument (slot mappings: padded and staged per call), or a static tensor read and written in place.
        Returns the new static tensors."""
        adopted = []
        dim = self.moved.get(next(iter(self.dynamic), ""), 0)  # the token arguments' layout ([batch, tokens]: 1)
        for name, value in list(arguments.items()):
            if not isinstance(value, torch.Tensor) or name in self.dynamic or name in self.static_ptrs:
                continue
            self.late.add(name)
            if not self.dynamic_given and dim < value.dim() <= 2 and value.shape[dim] == tokens:
                self.dynamic[name] = 0  # a late attention mask [1, tokens] beside batch-first ids
                if dim:
                    self.moved[name], arguments[name] = dim, value.movedim(dim, 0)
            else:
                self.static_ptrs[name] = value.data_ptr()
                adopted.append(value)
        return adopted

    def check_static(self, arguments: dict[str, Any]) -> None:
        for name, pointer in self.static_ptrs.items():
            value = arguments.get(name)
            if name in self.late:  # no graph reads it: calls with it differ from the first and run eagerly
                continue
            if not isinstance(value, torch.Tensor):
                given = "not given" if name not in arguments else f"a {type(value).__name__}"
                raise ValueError(
                    f"piecewise: static argument {name!r} was a tensor at capture and is {given} now. Captured "
                    f"graphs read it in place: pass the same tensor on every call, or compile a separate runner "
                    f"for calls without it"
                )
            if value.data_ptr() != pointer:
                raise ValueError(
                    f"piecewise: static argument {name!r} is not the tensor seen at capture ({self._moved(name, value)}). "
                    f"Captured graphs read static arguments in place: write new contents into the same tensor "
                    f"({name}.copy_(new)), mark it as a token argument with dynamic={{...}} where it has one row "
                    f"per token, or compile again"
                    + self._batch_first_hint(name)
                )

    def _moved(self, name: str, value: torch.Tensor) -> str:
        """How a static argument differs from the first call's: its dtype or device (a converted copy), else its
        storage."""
        first = (self.first_signature or {}).get(name)
        first_dtype, first_device = first[1:3] if type(first) is tuple and first[:1] == ("tensor",) else (None, None)
        changes = [f"has {what} {now} and had {then}" for what, now, then in (
            ("dtype", value.dtype, first_dtype), ("device", value.device.type, first_device)) if then not in (None, now)]
        return f"it {' and '.join(changes)}: a converted copy is another tensor" if changes else "its storage moved"

    def _batch_first_hint(self, name: str) -> str:
        """For a static argument that had one row per entry of dimension 1 of a token argument shaped [1, n] at the
        first call: the usual cause is a batch-first call (gpt-fast, transformers' [batch, seq] inputs)."""
        shapes = self.first_shapes
        static = shapes.get(name, ())
        for token_name in self.dynamic:
            tokens = shapes.get(token_name, ())
            if len(tokens) >= 2 and tokens[0] == 1 and static and static[0] == tokens[1] != 1:
                return (
                    f". At the first call {name!r} had {static[0]} rows and {token_name!r} shape {tokens}: piecewise "
                    f"takes dimension 0 as the token dimension, so that call had 1 token. If {token_name!r} is "
                    f"[batch, tokens], pass the tokens in dimension 0 and compile again"
                )
        return ""

    def signature(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Each argument's ``guards.summary``, a token tensor's token dimension left out."""
        def describe(name: str, value: Any) -> Any:
            if isinstance(value, torch.Tensor) and name in self.dynamic:
                return ("tensor", value.dtype, value.device.type, ("tokens", *value.shape[1:]))
            return summary(value)

        return {name: describe(name, value) for name, value in arguments.items()}

    def describe_change(self, last: dict[str, Any] | None) -> str:
        """What the last call's arguments changed since the first call's, where it changed: a field of an object, an
        item of a list (one line each, values shortened, tensors by dtype and shape)."""
        if self.first_signature is None or last is None:
            return "unknown change"
        now, first = self.signature(last), self.first_signature
        changes = [summary_difference(first.get(name, NOT_SET), now.get(name, NOT_SET), f"argument {name!r}")
                   for name in sorted(set(now) | set(first))]
        changes = [change for change in changes if change]
        return "; ".join(changes[:3]) + (f"; {len(changes) - 3} more" if len(changes) > 3 else "") if changes \
            else STATE_CHANGE


def call_tokens(model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """The tokens of a call of ``model`` as a runner with the default token arguments counts them."""
    binder = Arguments(model, None)
    return binder.token_count(binder.take(tuple(args), dict(kwargs)))


def guess_tokens(model: Any, args: tuple, kwargs: dict) -> int | None:
    """``call_tokens``, or where the runner's binding fails on these arguments (its own first call reports why) the
    rows of the first tensor argument; None without one."""
    try:
        return call_tokens(model, args, kwargs)
    except Exception:  # noqa: BLE001 - the runner's own first call reports what is wrong with the arguments
        return next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)


def other_token_dims(taken: Arguments, arguments: dict[str, Any], tokens: int) -> str:
    """A hint naming the static tensor arguments with a dimension as long as the call's tokens: token arguments
    left out of a ``dynamic=`` that names others (a pipeline stage's hidden states and residual), or in another
    layout (vLLM's M-RoPE positions [3, T])."""
    found = {name: next(d for d in range(value.dim()) if value.shape[d] == tokens)
             for name, value in arguments.items() if isinstance(value, torch.Tensor)
             and name not in taken.dynamic and tokens in tuple(value.shape)}
    if not found:
        return ""
    named = {**{name: taken.moved.get(name, 0) for name in taken.dynamic}, **found}
    shapes = ", ".join(f"{name!r} has shape {tuple(arguments[name].shape)}" for name in found)
    return f" Here {shapes}: if that dimension carries the tokens, name it: dynamic={named}."


def nested_rows(arguments: dict[str, Any], tokens: int) -> list[str]:
    """Tensors with ``tokens`` rows held inside non-tensor arguments (a dataclass, a dict, a list, an object's
    attributes: SGLang's ForwardBatch, vLLM's attention metadata), as ``argument.field``."""
    found = []
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor) or value is None:
            continue
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, (list, tuple)):
            items = enumerate(value)
        else:
            items = vars(value).items() if hasattr(value, "__dict__") and not isinstance(value, type) else ()
        for key, item in items:  # deeper too: vLLM's IntermediateTensors keeps its tensors in a dict, `.tensors`
            label = f"{name}.{key}" if not isinstance(key, int) else f"{name}[{key}]"
            found += [label + path for path, t in walk_tensors(item)
                      if t is not None and t.dim() > 0 and t.shape[0] == tokens]
    return found


def _batch_first(first: Any, arguments: dict[str, Any]) -> bool:
    """Token ids shaped [1, n > 1], or [b > 1, n] beside a 1-D tensor argument of n rows and no other tensor
    argument of b rows but those shaped [b, n]: the tokens lie in dimension 1."""
    if not isinstance(first, torch.Tensor) or first.dim() != 2 or first.is_floating_point() or first.is_complex():
        return False
    batch, count = first.shape
    if batch == 1:
        return count > 1
    others = [value for value in arguments.values() if isinstance(value, torch.Tensor) and value is not first]
    return batch != count and any(value.dim() == 1 and value.shape[0] == count for value in others) and not any(
        value.dim() >= 1 and value.shape[0] == batch and tuple(value.shape) != (batch, count) for value in others)
