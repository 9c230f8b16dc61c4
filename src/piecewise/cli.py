"""The ``piecewise`` command line.

    piecewise doctor path/to/file.py:factory [--json]
    piecewise run path/to/file.py:factory [RUNNER OPTIONS] [--json]
    piecewise checkpoint path/to/nvfp4-checkpoint [--json]
    piecewise verify path/to/file.py:factory [RUNNER OPTIONS] [--json PATH]
    piecewise bench TARGET [--random-weights] [--decode 1,8,32] [--prefill 512] [--json] [--plot FILE.png]
    piecewise generate CHECKPOINT_FOLDER [--random-weights] --prompt-ids 1,2,3 [-n 32]   (cli_tools.py)

RUNNER OPTIONS (``CaptureConfig`` fields): ``--max-tokens N --frontend auto|dynamo|breakable
--compiler auto|eager|inductor --strict``.

``factory()`` returns ``(model, args)`` or ``(model, args, kwargs)``; the file's folder is on the import path while
it loads. Exit status: 0 capture-safe, 1 blockers found or piecewise refused the model (one line says why and how
to fix it), 2 usage errors.

Each subcommand is one ``add_<name>(subparsers)`` function that registers its parser and sets
``handler``; ``main`` dispatches on it. Add a subcommand by writing one such function and listing it in
``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .cli_base import (
    EXIT_BLOCKED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    _console,
    _subcommand,
    load_target,
    output_path,
)
from .cli_tools import add_bench, add_cache, add_generate
from .config import FRONTENDS


def _add_runner_options(parser: argparse.ArgumentParser) -> None:
    """The ``CaptureConfig`` fields of every command that builds a runner."""
    parser.add_argument("--max-tokens", type=int, default=64, help="largest captured token count (default 64)")
    parser.add_argument("--frontend", default="auto", choices=FRONTENDS, help="front-end (default auto)")
    parser.add_argument("--compiler", default=None, choices=["eager", "inductor", "auto"],
                        help="piece compiler (default: $PIECEWISE_COMPILER, else auto: the faster one, measured at "
                             "the first call on CUDA)")
    parser.add_argument("--strict", action="store_true", help="fail on anything Dynamo cannot trace")


def _capture_config(options: argparse.Namespace) -> Any:
    """The ``CaptureConfig`` of ``_add_runner_options``; a value it refuses is a usage error."""
    import piecewise

    try:
        given = {"compiler": options.compiler} if options.compiler else {}
        return piecewise.CaptureConfig(max_tokens=options.max_tokens, frontend=options.frontend,
                                       strict=options.strict, **given)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def add_doctor(subparsers: argparse._SubParsersAction) -> None:
    parser = _subcommand(
        subparsers, "doctor", run_doctor, "list everything that stops a model from being captured, with fixes",
        "Run the model once eagerly, trace its forward with Dynamo and report every capture "
        "blocker (kind, call chain, fix). Exit 0 when capture-safe, 1 when blockers were found.")
    parser.add_argument("target", help="path/to/file.py:factory; factory() returns (model, args[, kwargs])")
    parser.add_argument("--splitting-ops", metavar="NS::OP,...",
                        help="the ops that run eagerly between captured pieces, as CaptureConfig(splitting_ops=...) "
                             "(default: every op made with piecewise.opaque_op(..., split=True))")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run_doctor(options: argparse.Namespace) -> int:
    target = load_target(options.target)  # first: a bad target is a usage error before torch is imported

    from piecewise.diagnose import doctor

    splitting = [name.strip() for name in options.splitting_ops.split(",") if name.strip()] \
        if options.splitting_ops else None
    try:
        # --json: stdout stays pure JSON even if the model prints
        with contextlib.redirect_stdout(sys.stderr) if options.json else contextlib.nullcontext():
            report = doctor(target.model, *target.args, splitting_ops=splitting, **target.kwargs)
    except ValueError as exc:  # a splitting op that is no registered op
        if splitting is None or "splitting_ops" not in str(exc):
            raise
        raise UsageError(str(exc)) from exc
    if options.json:
        print(report.to_json())
    else:

        report.render(_console())
    return EXIT_OK if report.ok else EXIT_BLOCKED


def add_run(subparsers: argparse._SubParsersAction) -> None:
    parser = _subcommand(
        subparsers, "run", run_run, "compile a model piecewise, run it, check it against eager and show what ran",
        "Compile the target's model with piecewise.compile, call it on the target's inputs "
        "and on every capture size's worth of them, compare with eager and print the runtime's stats. "
        "Exit 0 when outputs match eager, 1 when they do not.")
    parser.add_argument("target", help="path/to/file.py:factory or module:factory; factory() returns (model, args[, kwargs])")
    _add_runner_options(parser)
    parser.add_argument("--json", action="store_true", help="print the stats as JSON")


def run_run(options: argparse.Namespace) -> int:
    import copy
    import json

    target = load_target(options.target)  # first: a bad target is a usage error before torch is imported

    import torch

    import piecewise

    config = _capture_config(options)
    model = target.model
    args = [copy.deepcopy(a) if isinstance(a, torch.Tensor) else a for a in target.args]
    reference_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with torch.no_grad():
        expected = model(*reference_args, **target.kwargs)
    runner = piecewise.compile(model, config)
    output = runner(*args, **target.kwargs)  # a refusal is main's to print
    from .capture.outputs import output_tensors

    expected_leaves, output_leaves = output_tensors(expected), output_tensors(output)
    errors = [
        float((o.double() - e.double()).norm() / e.double().norm().clamp_min(1e-30))
        for o, e in zip(output_leaves, expected_leaves)
    ]
    worst = max(errors, default=0.0)
    low_precision = any(t.dtype in (torch.float16, torch.bfloat16) for t in expected_leaves)
    tolerance = 1e-2 if low_precision else 1e-5
    matches = len(output_leaves) == len(expected_leaves) and worst <= tolerance
    stats = {key: value for key, value in runner.stats.items() if key != "capture_sizes"}
    stats["capture_sizes"] = len(runner.stats["capture_sizes"])
    report = {"matches_eager": matches, "relative_error": worst, "tolerance": tolerance, "stats": stats}
    if options.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        from rich.table import Table

        console = _console()
        table = Table(title=f"piecewise run {options.target}", show_header=False)
        table.add_row("output vs eager", f"{'match' if matches else 'MISMATCH'} (relative error {worst:.2e}, tolerance {tolerance:.0e})")
        graphs = "yes" if stats["cuda_graphs"] else "no: pieces ran without graphs (no CUDA device or cuda_graphs=False)"
        table.add_row("CUDA graphs", graphs)
        for key in ("frontend", "pieces", "splitting_op_calls", "traces", "graph_breaks", "capture_sizes", "graphs",
                    "replays", "fallback_calls", "direct_calls", "capture_seconds", "pool_bytes", "prewarm_seconds"):
            value = stats[key]
            table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
        console.print(table)
    return EXIT_OK if matches else EXIT_BLOCKED


def add_checkpoint(subparsers: argparse._SubParsersAction) -> None:
    parser = _subcommand(
        subparsers, "checkpoint", run_checkpoint,
        "say what an NVFP4 checkpoint in ModelOpt's format holds, and what is wrong with it",
        "Read a ModelOpt NVFP4 checkpoint's headers and decode scales (no weights): quantized layers, "
        "experts, experts whose gate and up projections have different global scales (vLLM's fused-MoE loader "
        "keeps the gate's for both; load_modelopt_nvfp4 keeps both), and scales stored in the wrong convention. "
        "Exit 0 when it loads as it is, 1 when something is wrong.")
    parser.add_argument("folder", help="the checkpoint's folder (*.safetensors, hf_quant_config.json or config.json)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


def run_checkpoint(options: argparse.Namespace) -> int:
    import json

    from .integrations.modelopt_inspect import inspect_checkpoint

    try:
        found = inspect_checkpoint(options.folder)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if options.json:
        print(json.dumps(found, indent=2, default=str))
        return EXIT_OK if not found["problems"] else EXIT_BLOCKED
    from rich.table import Table

    table = Table(title=f"piecewise checkpoint {options.folder}", show_header=False)
    table.add_row("quantization", f"{found['quant'].get('quant_algo')}, group size {found['quant'].get('group_size', 16)}")
    table.add_row("NVFP4 linear layers", str(len(found["quantized"])))
    table.add_row("NVFP4 expert groups", f"{len(found['experts'])} ({sum(found['experts'].values())} experts)")
    table.add_row("other tensors", str(found["other"]))
    gate_up = found["gate_up"]
    if gate_up["of"]:
        low, high = gate_up["ratio"]
        table.add_row("gate / up global scales", f"differ in {gate_up['differ']} of {gate_up['of']} experts (up/gate "
                      f"{low:.3g} .. {high:.3g}); load_modelopt_nvfp4 keeps both")
    for problem in found["problems"]:
        table.add_row("[red]problem[/red]", problem)
    _console().print(table)
    return EXIT_OK if not found["problems"] else EXIT_BLOCKED


def add_verify(subparsers: argparse._SubParsersAction) -> None:
    parser = _subcommand(
        subparsers, "verify", run_verify, "check every captured size against eager, padded rows included",
        "Compile the target's model, capture, then run every capture size (the size, one token below it and the "
        "smallest count that pads to it) with inputs other than the capture's, comparing outputs and written "
        "state with eager. Inputs come from the factory's example, or from FACTORY_inputs(num_tokens) when the "
        "file defines it. Exit 0 when every size matches, 1 on a mismatch (the report names where the forward "
        "parts from eager), 2 on usage errors.")
    parser.add_argument("target", help="path/to/file.py:factory or module:factory; factory() returns (model, args[, kwargs])")
    _add_runner_options(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")


def run_verify(options: argparse.Namespace) -> int:
    output_path(options.json, "--json")
    target = load_target(options.target)  # first: a bad target is a usage error before torch is imported

    import piecewise

    runner = piecewise.compile(target.model, _capture_config(options))
    report = runner.verify(*target.args, make_inputs=target.make_inputs, **target.kwargs)
    report.render(_console())
    if options.json:
        with open(options.json, "w") as f:
            f.write(report.to_json() + "\n")
    return EXIT_OK if report.ok else EXIT_BLOCKED


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_doctor, add_run, add_checkpoint, add_verify,
                                                                  add_bench, add_generate, add_cache]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="piecewise", description="Piecewise CUDA graphs for PyTorch inference.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``piecewise`` console script; returns the exit status."""
    parser = build_parser()
    try:
        options = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help (0) and on bad arguments (2)
        return int(exit_.code or 0)
    saved_path = list(sys.path)  # a target's folder joins it for the command (cli_base._folder_on_path)
    try:
        return options.handler(options)
    except UsageError as exc:
        print(f"piecewise {options.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        if not _refusal(exc):
            raise  # a bug, in the model or in piecewise: its traceback matters
        print(f"piecewise {options.command}: {str(exc).removeprefix('piecewise: ')}", file=sys.stderr)
        return EXIT_BLOCKED
    finally:
        sys.path[:] = saved_path


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _refusal(exc: Exception) -> bool:
    """Whether ``exc`` is piecewise refusing the model, whose message says why and what to do: one of its errors,
    or a ``ValueError`` piecewise's own code raised (a bad argument, a KV cache too short)."""
    from .errors import REFUSALS

    if isinstance(exc, REFUSALS):
        return True
    raised_at = traceback.extract_tb(exc.__traceback__)[-1:]
    return isinstance(exc, ValueError) and any(os.path.abspath(f.filename).startswith(_PACKAGE) for f in raised_at)


if __name__ == "__main__":
    sys.exit(main())
