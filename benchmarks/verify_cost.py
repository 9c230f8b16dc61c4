"""What ``CaptureConfig(verify=...)`` adds to the first call on the L16 decode model (51 sizes, vLLM's ladder to
512), per front-end: first-call seconds with verify "off", "first_last" and "all", and the report's verdict.

    PYTHONPATH=src python benchmarks/verify_cost.py [--out DIR] [--frontends breakable,dynamo]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

import piecewise
from piecewise.models.decode import L16, DecodeLlama


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--frontends", default="breakable,dynamo")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = DecodeLlama(L16).to(device="cuda", dtype=torch.bfloat16).eval()
    cache = model.make_kv_cache(512)  # every size verified needs a sequence per token
    ids = torch.randint(0, L16.vocab_size, (128,), device="cuda")
    positions = torch.full((128,), L16.max_seq_len - 1, device="cuda")
    rows = {}
    for frontend in args.frontends.split(","):
        for verify in ("off", "first_last", "all"):
            runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=512, frontend=frontend, verify=verify))
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.no_grad():
                runner(ids, positions, cache)
            torch.cuda.synchronize()
            stats = runner.stats
            rows[f"{frontend}, verify={verify}"] = row = {
                "first_call_seconds": round(time.perf_counter() - started, 3),
                "capture_seconds": round(stats["capture_seconds"], 3), "sizes": len(stats["captured_sizes"]),
                "verify_seconds": round(stats["verify_seconds"], 3), "verified": len(stats["verified_sizes"])}
            runner.release_graphs()
            print(frontend, verify, row, flush=True)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
            "command": "PYTHONPATH=src python benchmarks/verify_cost.py " + " ".join(sys.argv[1:]),
            "model": "L16 decode (DecodeLlama: hidden 2048, 16 layers), bf16, cache of 512 sequences, first call of 128 tokens"}
    lines = ["# Cost of CaptureConfig(verify=...) at the first call, L16 decode model, 51 sizes", "",
             *(f"- {k}: {v}" for k, v in meta.items()), "",
             "| front-end, verify | first call s | capture s | verify s | sizes verified |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {r['first_call_seconds']} | {r['capture_seconds']} | {r['verify_seconds']} | "
              f"{r['verified']} |" for name, r in rows.items()]
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "verify_cost.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        with open(os.path.join(args.out, "verify_cost.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
