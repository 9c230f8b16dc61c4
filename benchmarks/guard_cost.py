"""What Dynamo's guard check costs a call of the Dynamo front-end (``DirectCall``), with the guards piecewise keeps
and with those it kept before 2026-12-02 (when the guards on the module tree's structure were dropped too: submodule
and attribute types and identities, instance attributes, hook dicts). The 16-layer L16 decode model, one runner
each, the check timed alone on the call's own frame (best of 5 rounds of 20000).

    PYTHONPATH=src python benchmarks/guard_cost.py [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch

import piecewise
from piecewise import _compat
from piecewise.models.decode import L16, DecodeLlama

NOW = _compat.drop_shape_guards
STRUCTURE = ("EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "ID_MATCH", "TYPE_MATCH")


def before(entries):
    """The filter as it was: the module tree's structure dropped with its tensors."""
    keep = NOW(entries)
    for index, entry in enumerate(entries):
        name = getattr(entry, "name", "")
        own = name == "self" or name.startswith(("self.", "self[", "L['self']"))
        if own and getattr(entry, "guard_type", None) in STRUCTURE:
            keep[index] = False
    return keep


def measure(device: str, filter_fn) -> tuple[float, int]:
    original = _compat.drop_shape_guards
    kept = []

    def counting(entries):
        keep = filter_fn(entries)
        kept.append(sum(keep))
        return keep

    _compat.drop_shape_guards = counting
    try:
        torch.manual_seed(0)
        model = DecodeLlama(L16).to(device, torch.bfloat16 if device == "cuda" else torch.float32).eval()
        cache = model.make_kv_cache(8)
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo", compiler="eager",
                                                                  cache_dir=None))
        ids, positions = torch.randint(0, 100, (4,), device=device), torch.full((4,), 3, device=device)
        with torch.no_grad():
            runner(ids, positions, cache)
    finally:
        _compat.drop_shape_guards = original
    direct = runner.frontend.tracer.direct
    with torch.inference_mode():
        arguments = {name: value.clone() if name != "kv_cache" else value
                     for name, value in runner.arguments.take((ids, positions, cache), {}).items()}
        frame = {**direct.defaults, **arguments, direct.self_name: direct.owner}
        assert direct.check(frame)
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(20000):
                direct.check(frame)
            best = min(best, (time.perf_counter() - started) / 20000)
    return best * 1e6, kept[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    out = parser.parse_args().out
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [(name, *measure(device, fn)) for name, fn in (("before (structure dropped)", before),
                                                           ("now (structure kept)", NOW))]
    lines = [f"# Dynamo guard check per call, L16 ({datetime.date.today()}, torch {torch.__version__}, "
             f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'})", "",
             "| guards | kept | µs per check |", "|---|---|---|"]
    lines += [f"| {name} | {count} | {us:.2f} |" for name, us, count in rows]
    text = "\n".join(lines)
    print(text)
    if out:
        with open(os.path.join(out, "guard-cost.md"), "w") as handle:
            handle.write(text + "\n")
        with open(os.path.join(out, "guard-cost.json"), "w") as handle:
            json.dump(rows, handle)


if __name__ == "__main__":
    main()
