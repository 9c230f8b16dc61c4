"""Capture cost of 51 sizes (vLLM's ladder to 512) on the L16 decode model, per front-end: first-call seconds,
capture seconds, pool bytes, graphs. Each front-end runs in a process of its own (no kernel, cuDNN plan or
Triton cache left by the other), under ``torch.inference_mode()`` as a server runs. Two figures put the capture
seconds in proportion on the host at hand: the eager forward once at each size (what any capture that runs the
model per size stands on), and a second capture in the same process (the attention's per-shape plans built: the
front-end's own cost).

    PYTHONPATH=src python benchmarks/capture_cost.py [--out DIR] [--profile] [--no-cudnn-sdpa]

``--no-cudnn-sdpa`` turns off SDPA's cuDNN backend (torch 2.11 picks it for this model's decode attention and
builds a plan at the first call of each shape, 42-74 ms: every capture size is a new shape).
``--profile`` prints where each front-end's first call spends its host time (cProfile, top 30 by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import subprocess
import sys
import time

import torch

FRONTENDS = ("breakable", "dynamo")


def one(frontend: str, profile: bool, cudnn_sdpa: bool) -> dict:
    import piecewise
    from piecewise.models.decode import L16, DecodeLlama

    torch.backends.cuda.enable_cudnn_sdp(cudnn_sdpa)
    torch.manual_seed(0)
    model = DecodeLlama(L16).to(device="cuda", dtype=torch.bfloat16).eval()
    cache = model.make_kv_cache(128)
    ids = torch.randint(0, L16.vocab_size, (128,), device="cuda")
    positions = torch.full((128,), L16.max_seq_len - 1, device="cuda")
    with torch.inference_mode():
        for _ in range(3):
            model(ids[:8], positions[:8], cache)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(20):
            model(ids[:8], positions[:8], cache)
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - started) * 1e3 / 20
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=512, frontend=frontend))
        profiler = cProfile.Profile() if profile else None
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        runner.capture(ids, positions, cache)
        if profiler:
            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
        first = time.perf_counter() - started
        # The floor any capture that runs the model's Python per size stands on, on this host: the eager forward
        # once at each size (a second pass, so that no first-use cost such as a cuDNN plan is in it).
        sizes = runner.stats["captured_sizes"]
        big = model.make_kv_cache(max(sizes))
        big_ids = torch.randint(0, L16.vocab_size, (max(sizes),), device="cuda")
        big_positions = torch.full((max(sizes),), L16.max_seq_len - 1, device="cuda")
        for _ in range(2):
            torch.cuda.synchronize()
            begun = time.perf_counter()
            for size in sizes:
                model(big_ids[:size], big_positions[:size], big)
            torch.cuda.synchronize()
        eager_ladder = time.perf_counter() - begun
        # The front-end's own cost: a second runner captured in this process, where the attention's per-shape
        # plans and every kernel are already built.
        again = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=512, frontend=frontend))
        again.capture(ids, positions, cache)
        again_seconds = again.stats["capture_seconds"]
    stats = runner.stats
    return {"first_call_seconds": round(first, 3), "capture_seconds": round(stats["capture_seconds"], 3),
            "sizes": len(stats["captured_sizes"]), "warmed_sizes": len(stats["warmed_sizes"]), "graphs": stats["graphs"], "pool_bytes": stats["pool_bytes"],
            "eager_step_ms_b8": round(eager_ms, 3), "eager_ladder_seconds": round(eager_ladder, 3),
            "capture_again_seconds": round(again_seconds, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-cudnn-sdpa", action="store_true")
    parser.add_argument("--one", choices=FRONTENDS, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("capture_cost.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps(one(args.one, args.profile, not args.no_cudnn_sdpa)))
        return 0
    rows = {}
    for frontend in FRONTENDS:
        command = [sys.executable, __file__, "--one", frontend] + (["--profile"] if args.profile else []) + \
            (["--no-cudnn-sdpa"] if args.no_cudnn_sdpa else [])
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
        rows[frontend] = json.loads(done.stdout.strip().splitlines()[-1])
        print(frontend, rows[frontend], flush=True)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
            "command": "PYTHONPATH=src python benchmarks/capture_cost.py " + " ".join(sys.argv[1:])}
    lines = ["# Capture cost per front-end, L16 decode model, 51 sizes (vLLM ladder to 512)", "",
             *(f"- {k}: {v}" for k, v in meta.items()), "- each front-end in a fresh process, torch.inference_mode()",
             f"- SDPA's cuDNN backend: {'off' if args.no_cudnn_sdpa else 'on (torch default)'}",
             "", "| front-end | first call s | capture s | sizes warmed up | graphs | pool MiB | eager step ms (B=8, this host) "
             "| eager forward at each size s (this host) | capture again s (plans built) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for frontend, row in rows.items():
        lines.append(f"| {frontend} | {row['first_call_seconds']} | {row['capture_seconds']} | {row['warmed_sizes']} | {row['graphs']} | "
                     f"{row['pool_bytes'] / 2**20:.0f} | {row['eager_step_ms_b8']} | {row['eager_ladder_seconds']} | "
                     f"{row['capture_again_seconds']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "capture_cost.json"), "w") as f:
            json.dump({"meta": meta, "capture": rows}, f, indent=2)
        with open(os.path.join(args.out, "capture_cost.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
