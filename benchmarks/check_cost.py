"""What the per-call checks cost: the L16 decode step (bf16, ``decode_step.py``'s model and inputs) through one
runner with every per-call check and through the same runner with them bypassed, in one process, in turn.

The checks of a call: the runner lock, parameter and buffer addresses (``ParameterWatch``), the global state,
train mode and argument kinds (``CallGuard``), breakable's attribute watch, and the front-end's state check before a
full-graph replay (Dynamo's guards of the first trace; breakable's attribute reads); the rest of the call path is the
same for both. Both front-ends, piecewise and full graphs (the default), B = 1 and 8.

    PYTHONPATH=src python benchmarks/check_cost.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

import piecewise
from piecewise.models.decode import L16, DecodeLlama

sys.path.insert(0, os.path.dirname(__file__))
from decode_step import inputs, round_robin_ms  # noqa: E402

BATCHES = (1, 8)


class _NoGuard:
    def difference(self, arguments):
        return None


class _NoWatch:
    def check(self):
        return None

    def __enter__(self):
        return None

    def __exit__(self, *exc_info):
        return None


def unchecked(runner):
    """The runner's call path with the per-call checks bypassed: a shallow copy (the same state, front-end, graphs
    and buffers) whose guard and watch check nothing, called without the lock, with the front-end's state check
    before full-graph replays skipped."""
    copy = __import__("copy").copy(runner)
    copy.guard, copy.watch = _NoGuard(), _NoWatch()
    frontend = runner.frontend

    def call(*args):
        frontend.check_state = lambda arguments, full: None
        try:
            return copy._call(args, {})
        finally:
            del frontend.check_state

    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_cost.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = DecodeLlama(L16).to(device="cuda", dtype=torch.bfloat16).eval()
    cache = model.make_kv_cache(max(BATCHES))
    cache.normal_()
    rows = []
    with torch.no_grad():
        for frontend in ("dynamo", "breakable"):
            for mode in ("piecewise", "full_and_piecewise"):
                runner = piecewise.compile(model, piecewise.CaptureConfig(
                    max_tokens=64, frontend=frontend, graph_mode=mode, max_decode_batch=max(BATCHES)))
                ids, positions, _ = inputs(max(BATCHES), cache, L16.vocab_size)
                runner.capture(ids, positions, cache)
                for batch in BATCHES:
                    ids, positions, _ = inputs(batch, cache, L16.vocab_size)
                    bypass = unchecked(runner)
                    torch.testing.assert_close(runner(ids, positions, cache), bypass(ids, positions, cache))
                    times = round_robin_ms({
                        "checked": lambda: runner(ids, positions, cache),
                        "unchecked": lambda: bypass(ids, positions, cache),
                    }, rounds=args.rounds)
                    cost = times["checked"] - times["unchecked"]
                    rows.append({"frontend": frontend, "graph_mode": runner.stats["graph_mode"], "batch": batch,
                                 "checked_ms": times["checked"], "unchecked_ms": times["unchecked"],
                                 "cost_us": cost * 1e3, "cost_percent": 100 * cost / times["unchecked"]})
                    print(f"{frontend:9} {mode:18} B={batch:<3} checked {times['checked']:.4f} ms  unchecked "
                          f"{times['unchecked']:.4f} ms  cost {cost * 1e3:+.1f} us ({rows[-1]['cost_percent']:+.2f}%)",
                          flush=True)
                runner.release_graphs()
    os.makedirs(args.out, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(), "command": "PYTHONPATH=src python benchmarks/check_cost.py"}
    with open(os.path.join(args.out, "check_cost.json"), "w") as handle:
        json.dump({**meta, "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
