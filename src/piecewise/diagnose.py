"""``piecewise.doctor``: list everything that stops a model from being captured, and how to fix each.

The doctor runs the model once eagerly (so lazily defined opaque ops get their schema and JIT kernels are
built outside tracing), then finds every blocker Dynamo reports for ``model.forward``, then, when the model
lives on a CUDA device, asks the runtime for a trial capture that finds ops illegal inside CUDA graphs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text

from torch.utils._python_dispatch import TorchDispatchMode

from piecewise.diagnostics.blockers import (
    Blocker,
    _source_file,
    blockers_from_exception,
    find_blockers,
    remembered,
    traced_regions,
)
from piecewise.diagnostics.attention_backends import watch_cudnn_attention
from piecewise.diagnostics.classify import FIXES
from piecewise.frontends.user_frames import chain_text, user_chain
from piecewise.opaque import check_fakes, opaque_call_counts, opaque_op_info, resolve_splitting_ops

logger = logging.getLogger(__name__)


@dataclass
class DoctorReport:
    """What the doctor found: ``blockers`` (empty when the model is capture-safe)."""

    blockers: list[Blocker] = field(default_factory=list)
    torch_version: str = field(default_factory=lambda: torch.__version__)
    trial_capture: bool = False
    """Whether a trial CUDA-graph capture ran (CUDA model and a runtime that provides it)."""
    first_call_checked: bool = False
    """Whether the runtime's first call ran on the inputs (padding check, token-count guards, state writes)."""
    warnings: list[str] = field(default_factory=list)
    """Hazards that block nothing but can give wrong numbers on CUDA graphs (see ``verify``)."""
    breakable_blockers: list[Blocker] | None = None
    """What stops the breakable front-end (its first call on the inputs), or None when it was not checked."""
    size_notes: list[str] = field(default_factory=list)
    """Sizes the Dynamo front-end's trace cannot serve ("calls of 1 token are padded to 2: ...")."""
    regions: int | None = None
    """Where Dynamo is blocked: the regions it traces between the blockers (``torch._dynamo.explain``'s graphs),
    which ``frontend="breakable", compiler="inductor"`` compiles with Inductor while each blocker's code runs as
    written; None where it was not counted."""
    auto: tuple[str | None, str] | None = None
    """What ``piecewise.compile(model)`` (``frontend="auto"``) did with these inputs: (the front-end it took, why),
    or (None, "") where it refused them; None where it was not run (Dynamo takes the forward whole)."""

    @property
    def ok(self) -> bool:
        """True when nothing blocks capture with the Dynamo front-end (and so with every front-end)."""
        return not self.blockers

    @property
    def frontends(self) -> dict[str, bool]:
        """Front-end → whether the model can use it, as checked."""
        usable = {"dynamo": self.ok}
        if self.breakable_blockers is not None:
            usable["breakable"] = not self.breakable_blockers
        return usable

    @property
    def recommended(self) -> tuple[str | None, str]:
        """The front-end to use, and why: what ``frontend="auto"`` takes, where it was run."""
        if self.auto is not None:
            taken, reason = self.auto
            if taken is None:
                return None, "neither front-end can take the forward as it is: fix the blockers below"
            inductor = "; with compiler='inductor' auto keeps Dynamo, for the fusion" if taken == "breakable" \
                and self.size_notes and self.ok else ""
            return taken, (f"frontend='auto' takes it ({reason})" if reason else "frontend='auto' takes it") + inductor
        if self.ok and self.size_notes:
            return "breakable", (f"Dynamo traces the forward whole, but with it {self.size_notes[0]}. With "
                                 f"eager pieces (compiler='eager', and the eager candidate of the default 'auto') breakable "
                                 f"runs the same pieces at every size, and frontend='auto' takes it; with Inductor "
                                 f"pieces auto keeps Dynamo, for the fusion")
        if self.ok:
            return "dynamo", "Dynamo traces the forward whole: its pieces can be compiled with Inductor"
        if self.breakable_blockers is not None and not self.breakable_blockers:
            return "breakable", (f"Dynamo is blocked ({len(self.blockers)} blocker(s) below), the breakable front-end "
                                 f"runs the forward as written; frontend='auto' takes it. Fixing the blockers brings "
                                 f"Dynamo and Inductor fusion back")
        return None, "neither front-end can take the forward as it is: fix the blockers below"

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "torch_version": self.torch_version,
            "trial_capture": self.trial_capture,
            "first_call_checked": self.first_call_checked,
            "blockers": [blocker.to_dict() for blocker in self.blockers],
            "frontends": self.frontends,
            "warnings": self.warnings,
            "recommended": self.recommended[0],
            "size_notes": self.size_notes,
            "breakable_blockers": [b.to_dict() for b in self.breakable_blockers or []],
            "regions": self.regions,
        }

    def to_json(self) -> str:
        """JSON with stable keys: ok, torch_version, trial_capture, first_call_checked, blockers[{kind, message,
        chain[{file, line, function, code}], fix}]."""
        return json.dumps(self.to_dict(), indent=2)

    def render(self, console: Console) -> None:
        """Print the report to a rich console: one panel per blocker, or a capture-safe line."""
        if self.ok:
            checked = ["Dynamo trace"] + (["piecewise first call"] if self.first_call_checked else []) + (
                ["trial CUDA-graph capture"] if self.trial_capture else [])
            checked = ", ".join(checked[:-1]) + " and " + checked[-1] if len(checked) > 1 else checked[0]
            console.print(Text(f"capture-safe: no blockers found ({checked}, torch {self.torch_version})",
                               style="bold green"))
            for warning in self.warnings:
                console.print(Text(f"warning: {warning}", style="yellow"))
            if self.size_notes:
                console.print(Text(f"front-ends: use {self.recommended[0]}: {self.recommended[1]}", style="bold"))
            return
        console.print(Text(f"{len(self.blockers)} capture blocker(s) found (torch {self.torch_version})",
                           style="bold red"))
        choice, reason = self.recommended
        if self.breakable_blockers is not None:
            console.print(Text(f"front-ends: dynamo blocked; breakable "
                               f"{'usable' if not self.breakable_blockers else 'blocked'}"
                               + (f" -> use {choice}: {reason}" if choice else f": {reason}"), style="bold"))
        # Cards wrap at the console's width even where lines do not (a piped console): soft-wrapped, a card
        # would be cut at its border, and the fix with it.
        if self.regions:
            console.print(Text(f"fusion: with compiler='inductor' the breakable front-end compiles the {self.regions} "
                               f"region(s) Dynamo traces between the blockers below; each blocker's code runs as "
                               f"written (frontend='auto' takes it when compiler='inductor')"))
        for index, blocker in enumerate(self.blockers, start=1):
            console.print(_panel(index, blocker), soft_wrap=False)
        for warning in self.warnings:
            console.print(Text(f"warning: {warning}", style="yellow"))
        for index, blocker in enumerate(self.breakable_blockers or [], start=len(self.blockers) + 1):
            console.print(Text("breakable front-end:", style="bold"))
            console.print(_panel(index, blocker), soft_wrap=False)

    def __str__(self) -> str:
        buffer = io.StringIO()
        console = Console(file=buffer, width=120, color_system=None, force_terminal=False)
        self.render(console)
        return buffer.getvalue()


def _panel(index: int, blocker: Blocker) -> Panel:
    parts: list[Any] = [Text(blocker.message)]
    if blocker.chain:
        chain = Text("\ncall chain (forward first):\n", style="bold")
        for depth, frame in enumerate(blocker.chain):
            chain.append(f"{'  ' * depth}{frame}\n", style="cyan")
            if frame.code:
                chain.append(f"{'  ' * depth}    {frame.code}\n", style="dim")
        parts.append(chain)
    fix = Text("fix: ", style="bold green")
    fix.append(blocker.fix)
    parts.append(fix)
    return Panel(Group(*parts), title=f"{index}. {blocker.kind}", title_align="left", border_style="red")


def _forward_of(model: Any) -> Callable:
    if isinstance(model, torch.nn.Module):
        return model.forward
    if callable(model):
        return model
    raise TypeError(f"doctor() needs an nn.Module or a callable, got {type(model).__name__}")


def _on_cuda(model: Any) -> bool:
    if not torch.cuda.is_available() or not isinstance(model, torch.nn.Module):
        return False
    tensors = [*model.parameters(), *model.buffers()]
    return any(tensor.is_cuda for tensor in tensors)


def _trial_capture(model: Any, args: tuple, kwargs: dict, hook: str = "trial_capture",
                   **options: Any) -> list[Blocker] | None:
    """Blockers from the runtime's trial first call (``hook``: ``trial_capture`` for the Dynamo front-end,
    ``breakable_trial`` for the breakable one; ``options`` go to it), or None when this runtime has none."""
    trial_capture = getattr(importlib.import_module("piecewise.runtime"), hook, None)
    if trial_capture is None:
        logger.debug("piecewise.runtime.%s is not available: skipping the trial capture", hook)
        return None
    try:
        return list(trial_capture(model, args, kwargs, **options))
    except Exception as exc:  # noqa: BLE001 - e.g. a Dynamo error the trace above reports too: as a blocker
        logger.debug("the trial first call raised %s", type(exc).__name__, exc_info=True)
        return blockers_from_exception(exc, root_file=_source_file(model))


def doctor(model: Any, *args: Any, splitting_ops: Any = None, **kwargs: Any) -> DoctorReport:
    """Check whether ``model(*args, **kwargs)`` can be captured; list every blocker with its fix.
    ``splitting_ops``: as ``CaptureConfig(splitting_ops=...)`` (ops of ``torch.library`` that run eagerly between
    captured pieces, named as the runner will be given them; None: every op made with ``split=True``).

    Runs the model once eagerly, then traces its forward with Dynamo (the model runs again, partly
    eagerly, while being traced), then runs piecewise's first call on the inputs (padding check, token-count
    guards, writes into state; with a CUDA-graph capture when the model is on CUDA). Dynamo's
    compiled-frame caches are reset along the way. Raises RuntimeError if the eager run itself fails, and
    ``FakeMismatch`` if an opaque op's fake describes other outputs than the op returned in it.
    """
    if splitting_ops is not None:
        resolve_splitting_ops(splitting_ops)  # a name that is no op: the ValueError the runner would raise
    splitting = getattr(importlib.import_module("piecewise.runtime"), "trial_splitting_ops", None)
    with splitting(splitting_ops) if splitting is not None else contextlib.nullcontext():
        return _doctor(model, args, kwargs, splitting_ops)


def _doctor(model: Any, args: tuple, kwargs: dict, splitting_ops: Any = None) -> DoctorReport:
    forward = _forward_of(model)
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if first is not None and first.shape[:1] == (1,) and first.dim() >= 3 and first.shape[1] > 1 and \
            first.is_floating_point():  # embeddings [1, T, H] (ids [1, T] are taken batch-first by the runtime)
        return DoctorReport(blockers=[_batch_first(model, first)])
    from .runtime.arguments import guess_tokens

    tokens = guess_tokens(model, args, kwargs)
    metadata = _MetadataOps(tokens)
    counts = opaque_call_counts()
    reads = _outside_reads(model, splitting_ops)
    with torch.no_grad(), remembered():  # the trace's blockers, found once for the trials too
        try:
            with watch_cudnn_attention(_on_cuda(model)) as cudnn, reads or contextlib.nullcontext(), \
                    metadata:  # the metadata check sees each custom op first
                model(*args, **kwargs)
        except Exception as exc:
            raise RuntimeError(
                f"the model fails when run eagerly ({type(exc).__name__}: {exc}); the doctor checks capture of "
                f"a working model: fix the eager error first, or check the example inputs"
            ) from exc
        check_fakes(name for name, count in opaque_call_counts().items() if count != counts.get(name, 0))
        blockers = find_blockers(forward, args, kwargs)
        regions = traced_regions(forward, args, kwargs) if blockers else None
        size_notes: list[str] = []
        trial = _trial_capture(model, args, kwargs, size_notes=size_notes) if isinstance(model, torch.nn.Module) \
            else None
        seen = {str(b.location) for b in blockers}  # one report per line: the trace's, which comes first
        blockers.extend(b for b in trial or [] if str(b.location) not in seen)
        breakable = auto = None
        seen_breakable: list = []
        outcome = _auto_trial(model, args, kwargs, bool(blockers), seen_breakable) \
            if (blockers or size_notes) and isinstance(model, torch.nn.Module) else None
        if outcome is not None:  # what compile(model) then does
            taken, reason, refused = outcome
            auto = (taken, reason)
            # one blocker per problem: the trace's, where it named the line or the kind. A refusal that names no
            # line (the padding check of a front-end that cannot say where rows mixed) joins only when the trace
            # named nothing: otherwise it is most likely what the named lines do (a branch over every row sees the
            # padding), and it stays listed with that front-end's blockers.
            kinds, lines = {b.kind for b in blockers}, {str(b.location) for b in blockers}
            blockers.extend(b for b in refused if b.kind not in kinds and str(b.location) not in lines
                            and (b.location is not None or not lines))
            if taken == "breakable":
                breakable = []
            elif blockers and seen_breakable:
                breakable = seen_breakable
            else:
                breakable = _trial_capture(model, args, kwargs, "breakable_trial")
    return DoctorReport(blockers=blockers, trial_capture=trial is not None and _on_cuda(model),
                        first_call_checked=trial is not None, breakable_blockers=breakable,
                        warnings=list(metadata.found.values()) + cudnn + (
                            importlib.import_module("piecewise.runtime.op_reads").doctor_warnings(reads)
                            if reads is not None else []), size_notes=size_notes, auto=auto,
                        regions=regions if regions and breakable == [] else None)


def _outside_reads(model: Any, splitting_ops: Any):
    """What custom ops read from outside their arguments in the eager run (``runtime/op_reads.py``)."""
    if not isinstance(model, torch.nn.Module):
        return None
    op_reads = importlib.import_module("piecewise.runtime.op_reads")
    return op_reads.watching(model, resolve_splitting_ops(splitting_ops), always=True)


def _auto_trial(model: Any, args: tuple, kwargs: dict, dynamo_blocked: bool,
                breakable: list) -> tuple[str | None, str, list[Blocker]] | None:
    """What ``frontend="auto"`` does on the inputs (``runtime.auto_trial``), or None when this runtime has no trial."""
    auto_trial = getattr(importlib.import_module("piecewise.runtime"), "auto_trial", None)
    if auto_trial is None:
        return None
    try:
        return auto_trial(model, args, kwargs, dynamo_blocked, breakable)
    except Exception as exc:  # noqa: BLE001 - e.g. a Dynamo error: as a blocker, compile would raise it too
        return None, "", blockers_from_exception(exc, root_file=_source_file(model))


def _batch_first(model: Any, first: torch.Tensor) -> Blocker:
    """A call shaped [1, T, ...]: piecewise would see one token, so no check would mean anything."""
    kind = "a transformers model" if type(model).__module__.startswith("transformers") else "the model"
    return Blocker(
        kind="batch_first",
        message=(f"the first tensor argument has shape {tuple(first.shape)}: dimension 0 is 1 and dimension 1 looks "
                 f"like the sequence, so by default piecewise would see a call of 1 token and nothing it checked would "
                 f"hold for real calls. The doctor checked nothing else; name the token dimension "
                 f"(piecewise.compile({'model'}, dynamic={{'name': 1}})) or call {kind} tokens-first, and run it "
                 f"again."),
        chain=[], fix=FIXES["batch_first"])


class _MetadataOps(TorchDispatchMode):
    """Opaque ops that are not splitting ops and take per-call metadata (an integer tensor with one entry per
    token: positions, slots): captured inside a graph, whatever they decide on the host from those values is
    frozen at the capture's."""

    def __init__(self, tokens: int | None):
        super().__init__()
        self.tokens = tokens
        self.found: dict[str, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        info = opaque_op_info(name) if self.tokens is not None and name not in self.found else None
        if info is not None and not info.split:
            values = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(func._schema.arguments)]
            per_token = [a.name for a, value in zip(func._schema.arguments, values)
                         if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() == 1
                         and value.shape[0] == self.tokens]
            if per_token:
                where = chain_text(user_chain()[-1:]) or "an unknown line"
                self.found[name] = (
                    f"`{name}` (called at {where}) is an opaque op but not a splitting op, and takes per-call "
                    f"metadata ({', '.join(per_token)}: one integer per token). Inside a CUDA graph it runs with the "
                    f"values of each call, but anything it decides on the host from them (a size read with .item(), "
                    f"a kernel configuration) is frozen at the capture's. If it does, make it a splitting op "
                    f"(split=True); runner.verify() checks every size against eager.")
        return func(*args, **kwargs)
