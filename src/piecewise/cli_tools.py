"""``piecewise bench`` and ``piecewise generate`` (registered in ``cli.SUBCOMMANDS``; torch loads when they run).

    piecewise bench path/to/file.py:factory [--tokens 1,8,32]
    piecewise bench CHECKPOINT_FOLDER [--random-weights] [--decode 1,8,32] [--prefill 512] [--context 512]
    piecewise generate CHECKPOINT_FOLDER [--random-weights] --prompt-ids 1,2,3 [--prompt "text"] [-n 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .cli_base import (EXIT_OK, UsageError, _console, _subcommand, load_target, non_negative_int, output_path,
                       positive_int)
from .errors import first_line


def _sizes(text: str, what: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{what} takes comma-separated token counts, e.g. 1,8,32; got {text!r}") from None
    if any(size < 1 for size in sizes):
        raise UsageError(f"{what} takes positive token counts, got {text!r}")
    return sizes


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--prompt-ids takes comma-separated token ids, e.g. 1,2,3; got {text!r}") from None
    if not ids or min(ids) < 0:
        raise UsageError(f"--prompt-ids takes one or more token ids of 0 or more, got {text!r}")
    return ids


def _is_checkpoint(target: str) -> bool:
    return os.path.isdir(target) or os.path.basename(target) == "config.json"


def _checkpoint(target: str, random_weights: bool):
    from .bench import load_transformers

    folder = os.path.dirname(target) if target.endswith("config.json") else target
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise UsageError(f"{folder}: no config.json there; give a transformers checkpoint folder (or its config.json)")
    has_weights = any(name.endswith((".safetensors", ".bin")) for name in os.listdir(folder))
    if not random_weights and not has_weights:
        raise UsageError(f"{folder} holds a config but no weights: add --random-weights to time the architecture")
    try:
        return load_transformers(folder, random_weights)
    except (ValueError, OSError, KeyError) as exc:  # an unknown model_type, a config that is not JSON
        raise UsageError(f"{folder}: transformers cannot load it: {first_line(exc)}") from exc


def add_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = _subcommand(
        subparsers, "bench", run_bench, "time eager and every piecewise mode side by side",
        "Time eager and each candidate mode (front-end × piece compiler × graph mode, and what auto takes) on one "
        "model: ms per call at each token count, the first call's seconds, the graph pool, the rel. error against "
        "eager. TARGET is path/to/file.py:factory (its FACTORY_inputs(num_tokens) gives inputs per --tokens), or a "
        "transformers checkpoint folder: decode steps of B sequences (--decode) and one-sequence prefills "
        "(--prefill).")
    parser.add_argument("target", help="path/to/file.py:factory, or a transformers checkpoint folder")
    parser.add_argument("--random-weights", action="store_true", help="a checkpoint folder's config, random weights")
    parser.add_argument("--tokens", default="", help="token counts of a factory target (needs FACTORY_inputs)")
    parser.add_argument("--decode", default=None, help="decode batches of a checkpoint (default 1,8,32)")
    parser.add_argument("--prefill", default=None, help="prefill lengths of a checkpoint (default 512)")
    parser.add_argument("--context", type=non_negative_int, default=512, help="cached tokens before each decode step")
    parser.add_argument("--modes", default="", help="comma-separated mode names to time (default: all)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="timing rounds per call (median)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw ms against tokens per mode and the start cost")


def run_bench(options: argparse.Namespace) -> int:
    from .bench import MODES

    modes = MODES
    output_path(options.plot, "--plot")
    if options.modes:
        names = [name.strip() for name in options.modes.split(",")]
        unknown = [name for name in names if name not in MODES]
        if unknown:
            raise UsageError(f"unknown mode(s) {unknown}; the modes: {', '.join(MODES)}")
        modes = {name: MODES[name] for name in names}
    if not _is_checkpoint(options.target) and (options.decode or options.prefill):
        raise UsageError("--decode and --prefill are for a transformers checkpoint folder; a factory target "
                         "takes --tokens (with FACTORY_inputs(num_tokens) beside the factory)")
    if _is_checkpoint(options.target):
        if options.tokens:
            raise UsageError("--tokens is for a path/to/file.py:factory target; a checkpoint folder takes --decode "
                             "(batches) and --prefill (lengths)")
        model_source = _checkpoint(options.target, options.random_weights)
        calls_of = "checkpoint"
    else:
        target = load_target(options.target)
        calls_of = "factory"
    import torch

    from . import bench
    from .integrations.transformers import TokenModel, enable
    from .runtime.arguments import guess_tokens

    if calls_of == "checkpoint":
        model = TokenModel(enable(model_source))
        calls = bench.transformers_calls(model, _sizes(options.decode or "1,8,32", "--decode"),
                                         _sizes(options.prefill or "512", "--prefill"),
                                         options.context)
    else:
        model = target.model
        tokens = _sizes(options.tokens, "--tokens")
        if tokens and target.make_inputs is None:
            factory = options.target.rpartition(":")[2]
            raise UsageError(f"--tokens needs {factory}_inputs(num_tokens) beside {factory} in the target's file: it "
                             f"returns the inputs of that many tokens")
        made = [(n, target.make_inputs(n)) for n in tokens] if tokens else [(None, (target.args, target.kwargs))]
        calls = []
        for n, inputs in made:
            args, kwargs = (inputs, {}) if not isinstance(inputs, tuple) or len(inputs) != 2 or \
                not isinstance(inputs[1], dict) else inputs
            args = args if isinstance(args, tuple) else (args,)
            count = n or guess_tokens(model, args, kwargs)  # [1, T] ids: T, as the runner counts them
            calls.append(bench.Call(f"{count} tokens", count, args, kwargs))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA: no graphs)"
    meta = {"target": options.target, "torch": torch.__version__, "device": device,
            "command": "piecewise bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])}
    console = _console()
    if not sys.stdout.isatty():  # piped: a table as wide as it needs, not cropped to 80 columns
        console.width = max(console.width, 90 + 14 * len(calls))
    with console.status("eager") as status:
        def progress(name: str) -> None:
            status.update(f"measured {name}")
            if not sys.stderr.isatty():  # piped: rich shows no status, and a mode can take minutes
                print(f"piecewise bench: measured {name}", file=sys.stderr, flush=True)

        rows = bench.measure(model, calls, modes, rounds=options.rounds, progress=progress)
    if options.plot:
        bench.plot(rows, calls, options.plot, options.target)
    if options.json:
        print(json.dumps(bench.to_json(rows, calls, meta), indent=2, default=str))
        return EXIT_OK
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"piecewise bench {options.target} ({device})")
    for column in ["mode", *(c.label + " ms" for c in calls), "first call s", "pool MiB", "max rel. error"]:
        table.add_column(column, justify="left" if column == "mode" else "right", no_wrap=column == "mode")
    fastest = {c.label: min((r.ms[c.label] for r in rows if c.label in r.ms), default=None) for c in calls}
    for row in rows:
        name = f"{row.name} → {row.chosen}" if row.name == "auto" else row.name
        if row.error:
            short = row.error if len(row.error) <= 160 else row.error[:157] + "... (below)"
            table.add_row(name, f"[red]{escape(short)}[/red]", *[""] * (len(calls) + 2))
            continue
        cells = [f"[bold]{row.ms[c.label]:.3f}[/bold]" if row.ms[c.label] == fastest[c.label] else
                 f"{row.ms[c.label]:.3f}" for c in calls]
        table.add_row(name, *cells, "" if row.first_call_s is None else f"{row.first_call_s:.1f}",
                      "" if not row.pool_bytes else f"{row.pool_bytes / 2**20:.0f}",
                      f"{max(row.rel_error.values(), default=0):.1e}")
    console.print(table)
    for row in rows:
        if row.error and len(row.error) > 160:
            console.print(f"[red]{row.name}[/red]: {escape(row.error)}")
    if options.plot:
        console.print(f"plot: {options.plot}")
    return EXIT_OK


def add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = _subcommand(
        subparsers, "generate", run_generate, "generate tokens with a transformers checkpoint under piecewise",
        "Prefill the prompts together and decode them (piecewise.generate), printing each prompt's new tokens as "
        "they come (as text where the folder has a tokenizer).")
    parser.add_argument("target", help="a transformers checkpoint folder")
    parser.add_argument("--random-weights", action="store_true", help="the folder's config, random weights")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt as text (needs the tokenizer)")
    parser.add_argument("--prompt-ids", action="append", default=[], help="a prompt as comma-separated token ids")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the new tokens as JSON")


def run_generate(options: argparse.Namespace) -> int:
    if not options.prompt and not options.prompt_ids:
        raise UsageError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    if not _is_checkpoint(options.target):
        raise UsageError(f"{options.target}: not a checkpoint folder (a folder with config.json)")
    ids = [_token_ids(text) for text in options.prompt_ids]
    model = _checkpoint(options.target, options.random_weights)
    tokenizer = None
    if options.prompt:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(options.target)
        except Exception as exc:  # noqa: BLE001 - any loading failure means the same to the user
            raise UsageError(f"--prompt needs a tokenizer in {options.target} ({exc}); give --prompt-ids") from exc
        ids += [tokenizer(text)["input_ids"] for text in options.prompt]
    import torch

    import piecewise

    prompts = [torch.tensor(p, dtype=torch.long) for p in ids]
    try:  # the request is checked when the stream is made: a bad one is a usage error, not a traceback
        stream = piecewise.generate_stream(model, prompts, options.max_new_tokens, temperature=options.temperature,
                                           top_k=options.top_k, top_p=options.top_p, seed=options.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    out: list[list[int]] = [[] for _ in prompts]
    for i, token in stream:
        out[i].append(token)
        if not options.json:
            print(f"[{i}] {token}", flush=True)
    if options.json:
        print(json.dumps({"new_tokens": out}))
    elif tokenizer is not None:
        for i, tokens in enumerate(out):
            print(f"[{i}] {tokenizer.decode(tokens)}")
    return EXIT_OK


def add_cache(subparsers: argparse._SubParsersAction) -> None:
    parser = _subcommand(
        subparsers, "cache", run_cache, "list or clear the persistent cache",
        "The persistent cache (piecewise.cache): what a first call recorded per model (the front-end it took) and "
        "Inductor's compiled artifacts. Its directory: --dir, else $PIECEWISE_CACHE_DIR, else ~/.cache/piecewise.")
    parser.add_argument("action", nargs="?", default="list", choices=("list", "clear"))
    parser.add_argument("--dir", default=None, help="the cache directory (default: as CaptureConfig's)")
    parser.add_argument("--json", action="store_true", help="print the entries as JSON")


def run_cache(options: argparse.Namespace) -> int:
    from rich.table import Table

    from . import cache

    root = cache.resolve(options.dir if options.dir is not None else cache.DEFAULT)
    if root is None:
        raise UsageError(f"the cache is off (${cache.ENVIRONMENT}={os.environ.get(cache.ENVIRONMENT)!r}); "
                         f"give --dir to look at a directory")
    store = cache.Store(root)
    if options.action == "clear":
        removed = store.clear()
        print(f"{root}: removed {removed} file(s)")
        return EXIT_OK
    entries = store.list()
    if options.json:
        print(json.dumps({"dir": str(root), "bytes": store.size_bytes(), "entries": entries}, indent=2))
        return EXIT_OK
    console = _console()
    console.print(f"{root}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, "
                  f"{store.size_bytes() / 2**20:.1f} MiB with Inductor's artifacts")
    if entries:
        if not sys.stdout.isatty():  # piped: whole names and keys, not cropped to 80 columns
            console.width = max(console.width, 200)
        table = Table("model", "front-end", "graph mode", "first call s", "key")
        for entry in entries:
            first = entry["first_call_s"]
            table.add_row(entry["model"], entry["frontend"], entry["graph_mode"],
                          f"{first:.1f}" if isinstance(first, (int, float)) else "", entry["key"])
        console.print(table)
    return EXIT_OK
