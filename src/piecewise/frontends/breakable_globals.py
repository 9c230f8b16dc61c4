"""Python values a breakable forward reads from module globals, and their change after capture.

A replay runs no Python, so a flag or a number the forward reads from a global (``USE_LORA``) or from an attribute
of a global object (vLLM's forward context, ``_ctx.scale``) stays what it was at capture. ``GlobalReads.record``
notes the lines of the model's own files (the modules of its classes) one run of the forward runs (a trace hook,
that run only), and reads from their bytecode each global those lines load, with the attributes taken from it
right after (``_ctx.scale``); those whose value is a plain Python value (a bool, int, float, str or None) are
compared before every replay, and a change raises, naming the global and the line that reads it. Left out: reads
inside splitting ops (those run on every call), globals the forward assigns itself (a counter: its own state, as
for module attributes), and any run under a debugger or coverage (their trace hook stays). Not seen: a value a
function returns (``get_context().scale``), a container's item (``SETTINGS["scale"]``), another library's code.
Dynamo guards such values itself.
"""

from __future__ import annotations

import builtins
import dis
import sys
from collections.abc import Callable
from typing import Any

from .. import opaque
from .user_frames import is_user_file, line_text

PLAIN = (bool, int, float, str, type(None))
"""The Python values a replay would keep that the watches compare (a flag, a number, a name)."""
_MISSING = object()


class GlobalReads:
    """The plain values the forward's own functions read from globals at the recorded run."""

    def __init__(self) -> None:
        self.entries: list[tuple[dict, str, tuple[str, ...], Any, tuple[str, int] | None]] = []
        """(the function's globals, the global's name, the attributes taken from it, the value, where)."""

    def record(self, run: Callable[[], Any], modules: set[str]) -> Any:
        """Run ``run()`` noting the lines it runs of ``modules`` (those of the model's module classes; not a gc
        callback's that ran meanwhile), not while a debugger or coverage traces (``sys.settrace`` would replace
        theirs)."""
        if sys.gettrace() is not None:
            return run()
        functions: dict[Any, tuple[dict, set[int]]] = {}
        skipped: set[Any] = set()

        def called(frame, event, arg):
            code = frame.f_code
            if event != "call" or code in skipped:
                return None
            if code not in functions:
                if frame.f_globals.get("__name__") not in modules or not is_user_file(code.co_filename):
                    skipped.add(code)
                    return None
                if inside_opaque_op(frame):  # this call only: the function may run outside one too
                    return None
                functions[code] = (frame.f_globals, set())
            lines = functions[code][1]

            def line(frame, event, arg):
                if event == "line":
                    lines.add(frame.f_lineno)
                return line

            return line

        sys.settrace(called)
        try:
            return run()
        finally:
            sys.settrace(None)
            found, stored = {}, set()  # stored: globals the forward assigns itself (a counter), its own state
            for code, (names, lines) in functions.items():
                stored |= {(id(names), i.argval) for i in dis.get_instructions(code) if i.opname == "STORE_GLOBAL"}
                for entry in _plain_reads(code, names, lines):
                    found.setdefault((id(entry[0]), entry[1], entry[2]), entry)
            self.entries = [entry for key, entry in found.items() if key[:2] not in stored]

    def refresh(self) -> None:
        """Take the values anew: after each run of the first call, whose forward may set globals of its own (a
        counter); only a change after it is one the graphs would miss."""
        self.entries = [(names, name, attributes, _resolve(names, name, attributes), where)
                        for names, name, attributes, _, where in self.entries]

    def changed(self) -> tuple[str, tuple[str, int] | None] | None:
        """(``name.attribute``, where it is read) of the first value that differs from the recorded run's."""
        for names, name, attributes, value, where in self.entries:
            now = _resolve(names, name, attributes)
            if not same(now, value):
                return ".".join((name, *attributes)), where
        return None

    def check(self) -> None:
        changed = self.changed()
        if changed is not None:
            raise ValueError(
                f"piecewise: the global `{changed[0]}` changed after the first call, and the forward reads it at "
                f"{line_text(changed[1])}. A replayed call runs no Python, so its graphs would go on using what it "
                f"held at capture. Pass the value to forward as an argument (a tensor is read in place, any other "
                f"value is checked on every call), read it inside a splitting op, use the Dynamo front-end (its "
                f"guards trace again for the new value), or compile again.")


def same(now: Any, then: Any) -> bool:
    """The same object, or an equal plain value of the same type."""
    return now is then or (type(now) in PLAIN and type(now) is type(then) and now == then)


def inside_opaque_op(frame) -> bool:
    """Whether ``frame`` runs inside an opaque op's body (a read there is the op's, which runs on every call)."""
    while frame is not None:
        if frame.f_code.co_name == "body" and frame.f_code.co_filename == opaque.__file__:
            return True
        frame = frame.f_back
    return False


def _plain_reads(code, names: dict, lines: set[int]) -> list[tuple[dict, str, tuple[str, ...], Any,
                                                                   tuple[str, int] | None]]:
    """Each ``LOAD_GLOBAL name`` on a line of ``code`` that ran, with the ``LOAD_ATTR``s right after it, whose
    value now is plain."""
    found, instructions = [], list(dis.get_instructions(code))
    starts, line, at = dict(dis.findlinestarts(code)), None, []  # offset → the line starting there (3.10-3.13)
    for instruction in instructions:
        at.append(line := starts.get(instruction.offset) or line)
    assigned = {(at[i], instruction.argval) for i, instruction in enumerate(instructions)
                if instruction.opname == "STORE_ATTR"}  # `_ctx.count += 1`: the forward's own state
    for index, instruction in enumerate(instructions):
        line = at[index]
        if instruction.opname != "LOAD_GLOBAL":
            continue
        name = instruction.argval
        if line not in lines or (name not in names and hasattr(builtins, name)):
            continue
        attributes: list[str] = []
        for following in instructions[index + 1:index + 4]:
            if following.opname != "LOAD_ATTR" or getattr(following, "arg", 0) and sys.version_info >= (3, 12) \
                    and following.arg & 1:  # 3.12+: a method load (a call follows)
                break
            attributes.append(following.argval)
        if attributes and (line, attributes[-1]) in assigned:
            continue
        for depth in range(len(attributes), -1, -1):  # the longest chain whose value is plain
            value = _resolve(names, name, tuple(attributes[:depth]))
            if type(value) in PLAIN:
                found.append((names, name, tuple(attributes[:depth]), value, (code.co_filename, line)))
                break
    return found


def _resolve(names: dict, name: str, attributes: tuple[str, ...]) -> Any:
    value = names.get(name, _MISSING)
    for attribute in attributes:
        if value is _MISSING:
            break
        try:
            value = getattr(value, attribute)
        except Exception:  # a property that fails now: not a plain value
            return _MISSING
    return value
