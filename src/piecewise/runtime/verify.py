"""``runner.verify()``: every captured size against eager, with inputs other than the capture's, padded rows
included, outputs and written state (KV caches) compared; a mismatch bisected to the stretch of the forward
between two splitting-op calls where the runner first parts from eager.

The model's state is put back afterwards: static tensors (caches) are copied before and restored after.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode

from ..capture.outputs import output_tensors
from ..capture.segment import runner_call
from ..capture.state import Call, Phase, probe_call
from ..errors import REFUSALS, first_line
from ..frontends.user_frames import chain_text, user_chain
from ..stored import values
from .model_state import model_state

CAUSES = ("Typical causes: a host-side decision frozen at capture (Python reading a value, a kernel configuration "
          "chosen from the token count), an op that reads per-call metadata and is not a splitting op (it was "
          "captured with the capture's metadata), or padding rows reaching code that combines tokens.")


def tolerance(dtype: torch.dtype) -> float:
    """Relative (norm-wise) error allowed for outputs of ``dtype``."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2 if dtype.is_floating_point else 0.0


def rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    if got.shape != expected.shape:
        return float("inf")
    if not expected.is_floating_point():
        return float((got != expected).double().mean()) if expected.numel() else 0.0
    if got.dtype == expected.dtype and torch.equal(got, expected):  # one pass, no float64 copy: most checked state
        return 0.0
    # In chunks: a KV cache upcast whole to float64 can take more memory than the device has.
    flat_got, flat_expected = got.reshape(-1), expected.reshape(-1)
    diff = norm = 0.0
    for start in range(0, flat_expected.numel(), 1 << 24):
        a, b = flat_got[start:start + (1 << 24)].double(), flat_expected[start:start + (1 << 24)].double()
        diff += float((a - b).square().sum())
        norm += float(b.square().sum())
    return (diff ** 0.5) / max(norm ** 0.5, 1e-30)


@dataclass
class SizeResult:
    """One capture size: the token counts tried, the largest error, and where a mismatch starts."""

    size: int
    tokens: list[int]
    max_error: float
    tolerance: float
    ok: bool
    worst: str = ""
    """What differed most: ``output N`` or ``static argument NAME``, at which token count."""
    diverges: str = ""
    """Where the runner first parts from eager (a mismatch only)."""


@dataclass
class VerifyReport:
    """What ``verify`` found, per size."""

    frontend: str
    cuda_graphs: bool
    results: list[SizeResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(result.ok for result in self.results)

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "frontend": self.frontend, "cuda_graphs": self.cuda_graphs,
                           "sizes": [asdict(result) for result in self.results]}, indent=2)

    def render(self, console: Console) -> None:
        graphs = "CUDA graphs" if self.cuda_graphs else "no CUDA graphs (padded pieces)"
        table = Table(title=f"piecewise verify: {self.frontend} front-end, {graphs}")
        for column in ("size", "tokens tried", "max error", "tolerance", "verdict"):
            table.add_column(column)
        for r in self.results:
            table.add_row(str(r.size), ", ".join(map(str, r.tokens)), f"{r.max_error:.1e}", f"{r.tolerance:.0e}",
                          "match" if r.ok else f"MISMATCH ({r.worst})")
        console.print(table)
        for r in self.results:
            if not r.ok:
                console.print(f"size {r.size}: {r.worst}; {r.diverges}\n{CAUSES}", soft_wrap=True)

    def __str__(self) -> str:
        buffer = io.StringIO()
        self.render(Console(file=buffer, width=160, color_system=None, force_terminal=False))
        return buffer.getvalue()


class _EagerProbe(TorchDispatchMode):
    """The eager forward, recording each splitting-op call's tensor inputs and where it was called."""

    def __init__(self, splitting: frozenset[str], state):
        super().__init__()
        self.splitting, self.state, self.where = splitting, state, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name in self.splitting:
            probe_call(self.state, args, kwargs)
            self.where.append(f"`{func._schema.name}` at {chain_text(user_chain()[-1:]) or 'an unknown line'}")
        return func(*args, **kwargs)


def token_counts(sizes: list[int], size: int) -> list[int]:
    """The size itself, one below it, and the smallest count that pads to it."""
    below = max([s for s in sizes if s < size], default=0)
    return sorted({size, max(size - 1, below + 1), below + 1}, reverse=True)


def default_inputs(runner: Any, example: dict[str, Any]) -> Callable[[int], dict[str, Any]]:
    """Inputs of any token count made from the example call, with values other than the capture's: token rows
    repeated from a shifted start; integer rows in an arithmetic pattern (positions) continued from one past the
    example's first value (one before it where every row holds the same value); static arguments as given. Where
    these leave the model's valid range (positions past the cache), pass ``make_inputs``."""
    names = runner.arguments.given_tokens(example)

    def make(tokens: int) -> dict[str, Any]:
        made = dict(example)
        for name in names:
            value = example[name]
            count = value.shape[0]
            steps = value[1:] - value[:-1] if count > 1 and value.dim() == 1 and not value.is_floating_point() else None
            if steps is not None and bool((steps == steps[0]).all()) and int(steps[0]) >= 0:
                step, first = int(steps[0]), int(value[0])
                # Other values than the capture's, never past the example's own: one position back where all rows
                # share one (decode at the end of a full cache), one forward otherwise.
                start = first - 1 if step == 0 and first > 0 else first + 1
                made[name] = start + step * torch.arange(tokens, device=value.device, dtype=value.dtype)
            else:
                made[name] = value[(torch.arange(tokens, device=value.device) + 1) % count]
        return made

    return make


def verify(runner: Any, example: dict[str, Any], sizes: list[int] | None = None,
           make_inputs: Callable[[int], Any] | None = None) -> VerifyReport:
    """See ``PiecewiseModel.verify``."""
    with torch.inference_mode():  # the runner's own mode: its buffers are inference tensors
        return _verify(runner, example, sizes, make_inputs)


def _verify(runner: Any, example: dict[str, Any], sizes: list[int] | None,
            make_inputs: Callable[[int], Any] | None) -> VerifyReport:
    ladder = list(runner.ladder.sizes)
    served = sorted({*runner.stats.captured_sizes, *runner.stats.full_only_sizes})  # sizes with graphs
    chosen = sorted(sizes) if sizes is not None else (served or ladder)
    unknown = [s for s in chosen if s not in ladder]
    if unknown:
        raise ValueError(f"verify: sizes {unknown} are not capture sizes of this runner; capture sizes: {ladder}")
    make = _inputs(runner, example, make_inputs)
    static = {name: value for name, value in example.items()
              if isinstance(value, torch.Tensor) and name not in runner.arguments.dynamic}
    # The model's own state is too (a gpt-fast KV cache in a buffer, vLLM's in a module attribute, a list of caches
    # in an argument): compared and put back like static arguments, written in place by both runs.
    static.update(dict(model_state(runner, example)))
    saved = {name: value.clone() for name, value in static.items()}
    stats, last = dict(runner.stats), runner.last_arguments  # verification's calls are not the user's
    report = VerifyReport(runner.stats.frontend, bool(runner.stats.cuda_graphs))
    try:
        for size in chosen:
            worst, worst_error, tol, bad_inputs, worst_bad = "", 0.0, 0.0, None, -1.0
            tried = token_counts(ladder, size)
            for tokens in tried:
                inputs = make(tokens)
                try:
                    errors = _compare(runner, inputs, static, saved)
                except (IndexError, RuntimeError, ValueError) as exc:
                    if make_inputs is not None or isinstance(exc, REFUSALS):
                        raise
                    raise ValueError(
                        f"verify: the model fails on the inputs verify made for {tokens} tokens ({first_line(exc)}). "
                        f"verify makes each capture size's inputs from the example call's; where the forward reads "
                        f"what it cannot make (metadata in a global forward context, rows counted in an object "
                        f"argument), pass make_inputs=lambda num_tokens: ... that returns (and sets up) a call of "
                        f"that many tokens") from exc
                for what, (error, allowed) in errors.items():
                    tol = max(tol, allowed)
                    if not error <= worst_error:  # NaN included
                        worst, worst_error = f"{what}, {tokens} tokens", error
                    if not error <= allowed and not error <= worst_bad:  # bisect the worst mismatch
                        bad_inputs, worst_bad = (tokens, inputs), error
            result = SizeResult(size, tried, worst_error, tol, bad_inputs is None, worst)
            if bad_inputs is not None:
                result.diverges = _bisect(runner, *bad_inputs, static, saved)
            report.results.append(result)
    finally:
        _restore(static, saved)
        runner.stats.update(stats)
        runner.last_arguments = last
    return report


def _inputs(runner, example, make_inputs) -> Callable[[int], dict[str, Any]]:
    if make_inputs is None:
        return default_inputs(runner, example)

    static = [name for name, value in example.items()
              if isinstance(value, torch.Tensor) and name not in runner.arguments.dynamic]

    def make(tokens: int) -> dict[str, Any]:
        made = make_inputs(tokens)
        args, kwargs = (made, {}) if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], dict)) \
            else made
        bound = runner.arguments.take(tuple(args) if isinstance(args, (tuple, list)) else (args,), dict(kwargs))
        return {**bound, **{name: example[name] for name in static}}  # the graphs read the captured ones

    return make


def _restore(static: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    for name, value in static.items():
        value.copy_(saved[name])


def _eager(runner, inputs: dict[str, Any], static, saved, probe: bool = False):
    """The model's own forward on copies of the static arguments (its buffers restored first): (output, the
    static tensors after it, the probe's calls, their lines)."""
    _restore(static, saved)
    copies = {name: saved[name].clone() for name in static if name in inputs}  # the static arguments
    state = runner.state
    recorder = None
    with torch.no_grad():
        if probe:
            state.probe, recorder = [], _EagerProbe(_splitting(runner), state)
            with recorder:
                output = runner.model(**{**inputs, **copies})
        else:
            output = runner.model(**{**inputs, **copies})
    calls = state.probe
    state.probe = None
    after = {name: (copies[name] if name in copies else value.clone()) for name, value in static.items()}
    return output, after, calls, recorder.where if recorder else []


def _splitting(runner) -> frozenset[str]:
    return runner.frontend.splitting_ops()


def _compare(runner, inputs: dict[str, Any], static, saved) -> dict[str, tuple[float, float]]:
    expected, expected_static, _, _ = _eager(runner, inputs, static, saved)
    _restore(static, saved)
    with runner_call():  # (also from inside the first call, which verify=True checks: not a call of its own)
        got = runner._call((), runner.arguments.own_layout(inputs))
    errors = {}
    for index, (ours, theirs) in enumerate(zip(output_tensors(got), output_tensors(expected))):
        errors[f"output {index}"] = (rel_error(ours, theirs), tolerance(theirs.dtype))
    for name, value in static.items():
        label = f"static argument {name!r}" if name in inputs else name
        ours, theirs = values(value), values(expected_static[name], value)  # an FP8 cache: as its values
        errors[label] = (rel_error(ours, theirs), tolerance(theirs.dtype))
    return errors


def _bisect(runner, tokens: int, inputs: dict[str, Any], static, saved) -> str:
    """The first splitting-op call whose inputs differ from eager's: the stretch before it is where it starts."""
    _, _, eager_calls, where = _eager(runner, inputs, static, saved, probe=True)
    _restore(static, saved)
    state = runner.state
    size = runner.ladder.bucket(tokens) or tokens
    names = runner.arguments.given_tokens(inputs)
    replays = state.capture_done and size not in runner.stats.full_only_sizes  # no piecewise graphs there
    phase = Phase.REPLAY if replays else Phase.PADDED
    staged = runner.stager.stage(inputs, names, tokens, size)
    state.probe = []
    try:
        runner.run_call(Call(phase, size, tokens), staged)
        calls = state.probe
    finally:
        state.probe = None
        _restore(static, saved)
    how = "replaying the graphs" if phase is Phase.REPLAY else "running the padded pieces"
    for index, (ours, theirs) in enumerate(zip(calls, eager_calls)):
        # A traced piece hands its tensors to the op in the order the graph first used them: match by shape.
        ours, theirs = (sorted(c, key=lambda t: tuple(t.shape)) for c in (ours, theirs))
        errors = [rel_error(a, b) for a, b in zip(ours, theirs)] or [0.0]
        allowed = max([tolerance(t.dtype) for t in theirs if t.is_floating_point()] or [0.0])
        if len(ours) != len(theirs) or not max(errors) <= allowed:
            start = f"after {where[index - 1]}" if index else "from the start of the forward"
            return (f"{how} at {tokens} tokens (size {size}), the inputs of splitting call {index} ({where[index]}) "
                    f"differ from eager by {max(errors):.1e}: the forward parts from eager {start} up to that call")
    if not where:
        return f"{how} at {tokens} tokens (size {size}): the forward has no splitting call to bisect at, so the " \
               f"stretch is the whole forward"
    return f"{how} at {tokens} tokens (size {size}), every splitting call gets eager's inputs: the forward parts " \
           f"from eager after {where[-1]}, up to its end"
