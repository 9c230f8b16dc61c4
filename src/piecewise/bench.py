"""``piecewise bench``: eager and every candidate mode of piecewise side by side on one model.

A *mode* is a front-end × piece compiler × graph mode (``MODES``), plus what ``auto`` (the default
``CaptureConfig``) takes. For each, ``measure`` compiles the model, times its first call (trace, compile,
capture), then each call of the workload (ms, median of rounds, the device synchronised), and compares every
output with eager's. A transformers model's workload is decode steps of B sequences (one token each, through the
slots of one KV cache) and prefills of one sequence; a ``file.py:factory`` target's is its inputs at each token
count (``<factory>_inputs(num_tokens)``, or the factory's own inputs). ``plot`` draws ms against tokens per mode
and the start cost.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

MODES: dict[str, dict] = {
    "dynamo": dict(frontend="dynamo", compiler="eager", graph_mode="piecewise"),
    "dynamo+full": dict(frontend="dynamo", compiler="eager", graph_mode="full_and_piecewise"),
    "dynamo+inductor": dict(frontend="dynamo", compiler="inductor", graph_mode="piecewise"),
    "dynamo+inductor+full": dict(frontend="dynamo", compiler="inductor", graph_mode="full_and_piecewise"),
    "breakable": dict(frontend="breakable", compiler="eager", graph_mode="piecewise"),
    "breakable+full": dict(frontend="breakable", compiler="eager", graph_mode="full_and_piecewise"),
    "breakable+inductor": dict(frontend="breakable", compiler="inductor", graph_mode="piecewise"),
    "breakable+inductor+full": dict(frontend="breakable", compiler="inductor", graph_mode="full_and_piecewise"),
}
"""The candidate modes, by the name the table shows (front-end, ``+inductor``: pieces compiled by Inductor,
``+full``: full graphs for decode): ``CaptureConfig`` fields each."""


@dataclass
class Call:
    """One timed call: its label (``decode B=8``, ``prefill 512``, ``16 tokens``), token count and arguments."""

    label: str
    tokens: int
    args: tuple
    kwargs: dict = field(default_factory=dict)


@dataclass
class Row:
    """One mode's measurements."""

    name: str
    config: dict
    ms: dict[str, float] = field(default_factory=dict)
    rel_error: dict[str, float] = field(default_factory=dict)
    first_call_s: float | None = None
    pool_bytes: int | None = None
    chosen: str = ""
    """What the runner took (front-end, graph mode): ``auto``'s choice, or where a mode fell back."""
    error: str = ""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(call: Callable[[], Any], rounds: int, iters: int) -> float:
    for _ in range(2):
        call()
    samples = []
    for _ in range(rounds):
        _sync()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        _sync()
        samples.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(samples)


def _rel_error(out: Any, ref: Any) -> float:
    from .capture.outputs import output_tensors

    leaves = [(o, r) for o, r in zip(output_tensors(out), output_tensors(ref)) if o.is_floating_point()]
    return max((float((o.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30)) for o, r in leaves),
               default=0.0)


def measure(model: torch.nn.Module, calls: list[Call], modes: dict[str, dict], *, rounds: int = 5, iters: int = 10,
            progress: Callable[[str], None] = lambda message: None) -> list[Row]:
    """Eager, then each mode of ``modes`` (name → ``CaptureConfig`` fields), then ``auto``, on ``calls``."""
    import piecewise

    max_tokens = max(call.tokens for call in calls)
    rows = [Row("eager", {})]
    expected = {}
    with torch.inference_mode():
        for call in calls:
            expected[call.label] = model(*call.args, **call.kwargs)
            rows[0].ms[call.label] = _timed(lambda call=call: model(*call.args, **call.kwargs), rounds, iters)
            rows[0].rel_error[call.label] = 0.0
        progress("eager")
        for name, fields in [*modes.items(), ("auto", {"compiler": "auto"})]:
            row = Row(name, fields)
            rows.append(row)
            try:
                runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=max_tokens, **fields))
                largest = max(calls, key=lambda c: c.tokens)
                _sync()
                start = time.perf_counter()
                runner(*largest.args, **largest.kwargs)
                _sync()
                row.first_call_s = time.perf_counter() - start
                for call in calls:
                    row.rel_error[call.label] = _rel_error(runner(*call.args, **call.kwargs), expected[call.label])
                    row.ms[call.label] = _timed(lambda call=call: runner(*call.args, **call.kwargs), rounds, iters)
                stats = runner.stats
                row.pool_bytes = stats["pool_bytes"]
                row.chosen = f"{stats['frontend']}, {runner.config.compiler} pieces, {stats['graph_mode']}"
            except Exception as exc:  # noqa: BLE001 - a mode the model cannot take is a row of the table
                row.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"  # whole: JSON; cut in the table
            finally:
                runner = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            progress(name)
    return rows


def transformers_calls(token_model, decode: list[int], prefill: list[int], context: int) -> list[Call]:
    """Decode steps of B sequences at position ``context`` (slots 0 .. B-1) and one-sequence prefills (in a slot
    of their own, so that no call reads rows another call wrote), over one multi-sequence cache (the graphs read
    it in place): every call computes the same each time it runs."""
    device = next(token_model.parameters()).device
    prefill_slot = max([*decode, 0])
    cache = token_model.make_kv_cache(max_seq_len=max([context + 1, *prefill]), sequences=prefill_slot + 1,
                                      device=device)
    vocab = token_model.model.config.vocab_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    calls = []
    for b in decode:
        ids = torch.randint(0, vocab, (b,), generator=generator).to(device)
        calls.append(Call(f"decode B={b}", b, (ids, torch.full((b,), context, device=device), cache,
                                                torch.arange(b, device=device))))
    for length in prefill:
        ids = torch.randint(0, vocab, (length,), generator=generator).to(device)
        calls.append(Call(f"prefill {length}", length, (ids, torch.arange(length, device=device), cache,
                                                        torch.full((length,), prefill_slot, device=device))))
    return calls


def load_transformers(path: str, random_weights: bool):
    """A causal LM from a local checkpoint folder (or its ``config.json``), bf16 on CUDA, float32 on the CPU;
    ``random_weights``: from the config alone."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    folder = os.path.dirname(path) if os.path.isfile(path) else path
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if random_weights:
        config = AutoConfig.from_pretrained(folder)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        for module in model.modules():  # stacked experts are left uninitialised outside from_pretrained
            for attr in ("gate_up_proj", "down_proj"):
                weight = getattr(module, attr, None)
                if isinstance(weight, torch.nn.Parameter) and weight.dim() == 3:
                    torch.nn.init.normal_(weight, std=0.02)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    return model.eval()


def to_json(rows: list[Row], calls: list[Call], meta: dict) -> dict:
    return {"meta": meta, "calls": [{"label": c.label, "tokens": c.tokens} for c in calls],
            "modes": [vars(row) for row in rows], "auto": next((r.chosen for r in rows if r.name == "auto"), "")}


def plot(rows: list[Row], calls: list[Call], path: str, title: str) -> None:
    """ms per call against its token count, per mode (log axes), and each mode's first call in seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    kinds = sorted({c.label.split()[0] for c in calls})  # decode / prefill, or one kind for a factory's calls
    styles = dict(zip(kinds, ("-", "--", ":")))
    for index, row in enumerate(rows):
        if row.error:
            continue
        label = row.name + (f" (→ {row.chosen})" if row.name == "auto" else "")  # one legend entry per mode
        for kind in kinds:
            points = sorted((c.tokens, row.ms[c.label]) for c in calls if c.label in row.ms and
                            c.label.split()[0] == kind)
            if points:
                left.plot(*zip(*points), styles[kind], marker="o", color=f"C{index % 10}", label=label)
                label = None
    xlabel = "tokens per call" + (" (" + ", ".join(f"{styles[k]} {k}" for k in kinds) + ")" if len(kinds) > 1 else "")
    left.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="ms per call", title=title)
    left.legend(fontsize=7, loc="upper left", framealpha=0.8)
    started = [row for row in rows if row.first_call_s is not None]
    right.barh([row.name for row in started], [row.first_call_s for row in started])
    right.set(xlabel="first call, s (trace, compile, capture)")
    right.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
