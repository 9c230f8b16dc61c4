"""Capture cost of 51 sizes (vLLM's ladder to 512) on the L16 decode model, per front-end: first-call seconds,
capture seconds, pool bytes, graphs.

    PYTHONPATH=src python benchmarks/capture_cost.py [--out DIR] [--profile]

``--profile`` prints where each front-end's first call spends its host time (cProfile, top 30 by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import sys
import time

import torch

import piecewise
from piecewise.models.decode import L16, DecodeLlama


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = DecodeLlama(L16).to(device="cuda", dtype=torch.bfloat16).eval()
    cache = model.make_kv_cache(128)
    ids = torch.randint(0, L16.vocab_size, (128,), device="cuda")
    positions = torch.full((128,), L16.max_seq_len - 1, device="cuda")
    rows = {}
    for frontend in ("breakable", "dynamo"):
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=512, frontend=frontend))
        profile = cProfile.Profile() if args.profile else None
        started = time.perf_counter()
        if profile:
            profile.enable()
        runner.capture(ids, positions, cache)
        if profile:
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)
        stats = runner.stats
        rows[frontend] = {"first_call_seconds": round(time.perf_counter() - started, 3),
                          "capture_seconds": round(stats["capture_seconds"], 3), "sizes": len(stats["captured_sizes"]),
                          "graphs": stats["graphs"], "pool_bytes": stats["pool_bytes"]}
        runner.release_graphs()
        print(frontend, rows[frontend], flush=True)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
            "command": "PYTHONPATH=src python benchmarks/capture_cost.py " + " ".join(sys.argv[1:])}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "capture_cost.json"), "w") as f:
            json.dump({"meta": meta, "capture": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
