"""What the breakable front-end learns of a forward by running it, since it traces nothing.

- ``Survey``: the forward run unpadded at two token counts. At each call site (a splitting op, or a write into a
  static tensor, and its occurrence in the forward) the dimensions that follow the token count from one run to the
  other carry tokens, and so do the Python ints that follow it; the forward's outputs likewise. A dimension that
  merely equals the padded size at one count is never taken for a token dimension.
- ``OpLog``: the ops one run dispatched with their Python arguments (numbers, dtypes, flags), compared as it runs
  with another run's: at the same call a difference is a Python value that changes from run to run (a random draw,
  a counter), which a captured graph would freeze; at another size a path or value that depends on the token count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture.splitcall import Roles
from ..errors import ForwardRefused
from .user_frames import innermost_user_line, line_text


@dataclass
class Observed:
    """One call site in one run: its inputs (shapes of tensors, values of Python ints) and its outputs' shapes."""

    inputs: list[Any]
    outputs: list[Any]
    where: str
    offsets: list[Any] = field(default_factory=list)
    """Each input tensor's storage offset (None for other values): where a write lands in a static tensor."""


def offsets(values: list[Any]) -> list[Any]:
    return [v.storage_offset() if isinstance(v, torch.Tensor) else None for v in values]


def shapes(values: list[Any]) -> list[Any]:
    """Tensors by shape, ints by value, anything else as None."""
    return [tuple(v.shape) if isinstance(v, torch.Tensor) else v if type(v) is int else None for v in values]


@dataclass
class Survey:
    """Call sites and outputs of the forward at two token counts (``runs``: count → what was seen)."""

    runs: list[tuple[int, dict[tuple, Observed], list[Any]]] = field(default_factory=list)
    roles: dict[tuple, Roles] = field(default_factory=dict)
    output_dims: list[int | None] | None = None
    """Per leaf of the forward's output: its token dimension, or None."""

    def observe(self, tokens: int, calls: dict[tuple, Observed], outputs: list[Any]) -> None:
        self.runs.append((tokens, calls, shapes(outputs)))

    def settle(self) -> None:
        """Decide each call site's roles and the outputs' token dimensions from the two runs."""
        (a, calls_a, out_a), (b, calls_b, out_b) = self.runs[:2]
        for key, seen_a in calls_a.items():
            seen_b = calls_b.get(key)
            if seen_b is None or len(seen_a.inputs) != len(seen_b.inputs):
                continue  # the forward's path differs between the two counts: the shape rule serves this site
            inputs, counts, fixed = [], [], []
            for index, (x, y) in enumerate(zip(seen_a.inputs, seen_b.inputs)):
                if isinstance(x, tuple) and isinstance(y, tuple):
                    dims = _follow(x, y, a, b, f"input {index} of `{key[1]}` at {seen_a.where}")
                    inputs.extend((index, d) for d in dims)
                    if dims and key[0] == "write" and index == 0 and seen_a.offsets[:1] != seen_b.offsets[:1]:
                        raise ForwardRefused(
                            f"piecewise: `{key[1]}` at {seen_a.where} writes the call's rows into a static tensor at "
                            f"a place that moves with the token count (element {seen_a.offsets[index]} at {a} tokens, "
                            f"{seen_b.offsets[index]} at {b}: mem[-T:] = x, narrow from the end). Every call is padded "
                            f"to a capture size, so the rows would land where the padded count puts them. Write at "
                            f"positions given as a tensor argument (index_copy_), or make that code a splitting op "
                            f"(piecewise.opaque_op(..., split=True)), which sees the real count.", "token_mixing")
                elif type(x) is int and type(y) is int and x != y:
                    counts.append((index, _affine(x, y, a, b, f"`{key[1]}` at {seen_a.where}")))
                elif type(x) is int and type(y) is int:
                    fixed.append((index, x))
            outputs = []
            for index, (x, y) in enumerate(zip(seen_a.outputs, seen_b.outputs)):
                dims = _follow(x, y, a, b, f"output {index} of `{key[1]}` at {seen_a.where}") \
                    if isinstance(x, tuple) and isinstance(y, tuple) else []
                if dims and dims != [0]:
                    where = f"splitting op `{key[1]}` at {seen_a.where} returns output {index} of shape {x} for {a} tokens"
                    raise ForwardRefused(
                        f"piecewise: {where}, with the token count in dimensions {', '.join(map(str, dims))}; piecewise "
                        f"pads and cuts dimension 0 only, so the others would keep the padded count: return one row "
                        f"per token (compute what spans the tokens twice inside the op)" if dims[0] == 0 else
                        f"piecewise: {where}, with the tokens in dimension {dims[0]}, not 0; piecewise pads and cuts "
                        f"dimension 0: return it tokens-first (.transpose(0, {dims[0]}) inside the op, and back "
                        f"outside it)", "token_layout")
                outputs.append(bool(dims))
            self.roles[key] = Roles(tuple(inputs), tuple(counts), tuple(outputs), fixed=tuple(fixed))
        if len(out_a) == len(out_b):
            self.output_dims = [(_follow(x, y, a, b, f"output {i} of the forward") or [None])[0]
                                if isinstance(x, tuple) and isinstance(y, tuple) else None
                                for i, (x, y) in enumerate(zip(out_a, out_b))]


def _affine(x: int, y: int, a: int, b: int, where: str):
    """The count itself (None), or ``slope * count + offset`` through (a, x) and (b, y) with whole numbers (a
    ``2 * x.shape[0]``); padded runs check it at every size (``SplitCall``)."""
    if (x, y) == (a, b):
        return None
    slope, rest = divmod(x - y, a - b)
    offset = x - slope * a
    if rest or slope == 0:
        raise ForwardRefused(
            f"piecewise: {where} is given the int {x} at {a} tokens and {y} at {b}: a number that changes with the "
            f"token count but is neither the count nor a whole multiple of it plus a constant. Captured calls are "
            f"padded, and piecewise gives an op the real count (x.shape[0]) or such a function of it, nothing else: "
            f"pass the count, or compute the number inside the op.", "token_layout")
    return _Affine(slope, offset)


class _Affine:
    """``slope * count + offset``, the int a call site is given for a call of ``count`` tokens."""

    __slots__ = ("slope", "offset")

    def __init__(self, slope: int, offset: int):
        self.slope, self.offset = slope, offset

    def __call__(self, count: int) -> int:
        return self.slope * count + self.offset


def _follow(x: tuple, y: tuple, a: int, b: int, what: str) -> list[int]:
    """Dimensions of a tensor (shape ``x`` at ``a`` tokens, ``y`` at ``b``) that are the token count."""
    if len(x) != len(y):
        return []
    dims = [d for d, (p, q) in enumerate(zip(x, y)) if (p, q) == (a, b)]
    grows = [d for d, (p, q) in enumerate(zip(x, y)) if p != q and d not in dims]
    if grows:
        d = grows[0]
        raise ForwardRefused(
            f"piecewise: {what} has dimension {d} of {x[d]} at {a} tokens and {y[d]} at {b}: it grows with the token "
            f"count without being it, so piecewise cannot cut it to a call's real tokens. Keep one row per token in "
            f"one dimension (reshape [tokens * n, ...] to [tokens, n, ...]).", "token_layout")
    return dims


def python_arguments(args: tuple, kwargs: dict | None) -> tuple:
    """The Python values among an op's arguments: numbers, flags, dtypes, shapes (a list of tensors by its length)."""
    found: list[Any] = []
    for value in args:
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, (list, tuple)):
            found.append(tuple(v for v in value if not isinstance(v, torch.Tensor)) or len(value))
        else:
            found.append(value)
    if kwargs:
        found.extend((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))
    return tuple(found)


def _agree(x: Any, y: Any, same_call: bool) -> bool:
    """Whether two Python arguments agree: equal, or, between runs at different sizes, ints anywhere (shapes follow the
    token count)."""
    if same_call:
        return x == y
    if type(x) is int and type(y) is int:
        return True
    if isinstance(x, tuple) and isinstance(y, tuple):
        return len(x) == len(y) and all(_agree(p, q, False) for p, q in zip(x, y))
    return x == y


class OpLog:
    """The ops of one run with their Python arguments and model lines, compared as they come with earlier runs'
    (``references``: (their size, whether they ran the same call, their log)), noting the first difference from each
    with the model line where it happened."""

    __slots__ = ("entries", "lines", "references", "differences", "stopped", "upload_at")

    def __init__(self, references: list[tuple[int, bool, "OpLog"]] = ()):
        self.entries: list[tuple] = []
        self.lines: list[tuple[str, int] | None] = []
        self.references = [(size, same, log) for size, same, log in references]
        self.differences: list[str | None] = [None] * len(self.references)
        self.stopped = False
        self.upload_at: set[int] = set()
        """Where an op uploaded host data (``torch.tensor(list)``, a copy from the host)."""

    def stop(self) -> None:
        """A value was read back to the host (outside a capture: a CPU run): what follows may branch on data,
        which differs between runs, so the runs are compared up to here."""
        self.stopped = True

    def add(self, func: Any, args: tuple, kwargs: dict | None) -> None:
        if self.stopped:
            return
        entry = (func, python_arguments(args, kwargs))
        index = len(self.entries)
        self.entries.append(entry)
        self.lines.append(line := innermost_user_line())
        for position, (_, same, log) in enumerate(self.references):
            if self.differences[position] is not None:
                continue
            entries = log.entries
            other = entries[index] if index < len(entries) else None
            if other is not None and other[0] is func:
                if len(other[1]) != len(entry[1]) or not all(_agree(p, q, same) for p, q in zip(other[1], entry[1])):
                    self.differences[position] = f"{_op(func)} at {line_text(line)} ({entry[1]}; the other run: " \
                                                 f"{other[1]})"
                continue
            # Another op here. The same call at the same size takes another path only through data or first-use
            # work (a table built once), and between sizes a path that only uploads host data is first-use work
            # too: the comparison ends there. Any other change of path between sizes is a branch on the count.
            if same or _uploads(func, args) or (other is not None and log.uploads(index)):
                self.differences[position] = ""
            elif other is None:
                self.differences[position] = f"{_op(func)} at {line_text(line)} (an op the other run did not reach)"
            else:
                self.differences[position] = f"{_op(func)} at {line_text(line)} (the other run had {_op(other[0])} " \
                                             f"at {line_text(log.lines[index])} there)"
        if _uploads(func, args):
            self.upload_at.add(index)

    def uploads(self, index: int) -> bool:
        return index in self.upload_at

    def finish(self) -> list[tuple[int, bool, str]]:
        """(size, same call, where) of each earlier run this one differs from."""
        found = []
        for position, (size, same, log) in enumerate(self.references):
            difference = self.differences[position]
            if difference is None and len(log.entries) > len(self.entries) and not (self.stopped or log.stopped
                                                                                     or same):
                index = len(self.entries)
                difference = f"the end of the forward, where the other run went on to {_op(log.entries[index][0])} " \
                             f"at {line_text(log.lines[index])}"
            if difference:  # "": the comparison ended without a verdict
                found.append((size, same, difference))
        return found


_UPLOADS = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy", "aten::scalar_tensor"})


def _uploads(func: Any, args: tuple) -> bool:
    """Whether an op brings host data to the device: a tensor made from Python values, or a copy from the host."""
    name = func._schema.name
    if name in _UPLOADS:
        return True
    if name in ("aten::_to_copy", "aten::copy_"):
        source = args[1] if name == "aten::copy_" and len(args) > 1 else args[0] if args else None
        return isinstance(source, torch.Tensor) and source.device.type == "cpu"
    return False


def _op(func: Any) -> str:
    return f"`{func.overloadpacket.__name__}`"

