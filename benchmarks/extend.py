"""Extend (one sequence of T new tokens) on the "L16" model for each front-end, capture cost for 51 and 58 sizes,
and what padding costs against running a call without graphs (the ``max_padding_factor`` trade-off).

    PYTHONPATH=src python benchmarks/extend.py --out DIR [--skip-inductor]

Variants: eager; piecewise breakable; piecewise Dynamo with eager pieces; with inductor pieces. ms per call,
host-inclusive (median of rounds, variants sampled in turn).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

import torch

import piecewise
from piecewise.config import sglang_sizes
from piecewise.models.decode import L16
from piecewise.models.llama import TinyLlama

LENGTHS = (16, 256, 1024, 4096, 8192)  # on the sglang ladder: no padding
BETWEEN = (33, 257, 1025, 4097)  # one above a ladder size: the most padding (to 48, 288, 1280, 4608)
CONFIG = dataclasses.replace(L16, max_seq_len=16384)


def sample_ms(fn, iters: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def median_ms(steps: dict, rounds: int = 5) -> dict:
    for fn in steps.values():
        fn()
    samples = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            samples[name].append(sample_ms(fn, 3))
    return {name: statistics.median(values) for name, values in samples.items()}


def capture_cost(model, cache, frontend: str, compiler: str, schedule: str, max_tokens: int) -> dict:
    config = piecewise.CaptureConfig(max_tokens=max_tokens, size_schedule=schedule, frontend=frontend, compiler=compiler)
    runner = piecewise.compile(model, config)
    ids = torch.randint(0, CONFIG.vocab_size, (max_tokens,), device="cuda")
    started = time.perf_counter()
    runner.capture(ids, torch.arange(max_tokens, device="cuda"), cache)
    first = time.perf_counter() - started
    stats = runner.stats
    result = {"sizes": len(stats["captured_sizes"]), "capture_seconds": round(stats["capture_seconds"], 3),
              "first_call_seconds": round(first, 3), "pool_bytes": stats["pool_bytes"], "graphs": stats["graphs"],
              "warmed_sizes": len(stats["warmed_sizes"]),
              "frontend": stats["frontend"]}
    return runner, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-inductor", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("extend.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = TinyLlama(CONFIG).to(device="cuda", dtype=torch.bfloat16).eval()
    cache = model.make_kv_cache()
    variants = [("breakable", "eager"), ("dynamo", "eager")] + ([] if args.skip_inductor else [("dynamo", "inductor")])
    capture, runners = {}, {}
    with torch.no_grad():
        for frontend, compiler in variants:
            name = f"{frontend} ({compiler})"
            runner, capture[f"{name}, 51 sizes (vllm, 512)"] = capture_cost(model, cache, frontend, compiler, "vllm", 512)
            print(name, "51 sizes:", capture[f"{name}, 51 sizes (vllm, 512)"], flush=True)
            runner.release_graphs()
            del runner
            torch.cuda.empty_cache()
            runners[name], capture[f"{name}, 58 sizes (sglang, 8192)"] = capture_cost(
                model, cache, frontend, compiler, "sglang", 8192)
            print(name, "58 sizes:", capture[f"{name}, 58 sizes (sglang, 8192)"], flush=True)
        results, errors = {}, {}
        for tokens in LENGTHS + BETWEEN:
            ids = torch.randint(0, CONFIG.vocab_size, (tokens,), device="cuda")
            positions = torch.arange(tokens, device="cuda")
            reference = model(ids, positions, cache).float()
            steps = {"eager": lambda ids=ids, positions=positions: model(ids, positions, cache)}
            for name, runner in runners.items():
                out = runner(ids, positions, cache)
                errors.setdefault(name, {})[tokens] = float((out.float() - reference).norm() / reference.norm())
                steps[name] = lambda r=runner, ids=ids, positions=positions: r(ids, positions, cache)
            for name, ms in median_ms(steps).items():
                results.setdefault(name, {})[tokens] = ms
            print(tokens, {name: round(row[tokens], 3) for name, row in results.items()}, flush=True)
    ladder = sglang_sizes(8192)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
            "command": "PYTHONPATH=src python benchmarks/extend.py " + " ".join(sys.argv[1:]),
            "model": "L16 (TinyLlama: hidden 2048, 16 q / 4 kv heads, head_dim 128, FFN 5632, 16 layers), bf16, one "
                     "sequence from position 0, attention op kernels.attention"}
    lines = ["# Extend, L16 model, per front-end", "", *(f"- {k}: {v}" for k, v in meta.items()), "",
             "ms per call (host-inclusive; median of 5 rounds of 3 calls); rel. error vs eager in brackets", "",
             "| T (padded to) | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for tokens in LENGTHS + BETWEEN:
        size = next(s for s in ladder if s >= tokens)
        cells = [f"{results[name][tokens]:.3f}" + (f" ({errors[name][tokens]:.1e})" if name in errors else "")
                 for name in results]
        lines.append(f"| {tokens} ({size}) | " + " | ".join(cells) + " |")
    lines += ["", "Padded against unpadded: eager runs a call of T tokens as it is, which is what "
              "CaptureConfig(max_padding_factor=...) falls back to for a call padded more than that factor:", ""]
    for tokens in BETWEEN:
        size = next(s for s in ladder if s >= tokens)
        best = {name: round(results["eager"][tokens] / results[name][tokens], 2) for name in results if name != "eager"}
        lines.append(f"- T={tokens} padded to {size} (factor {size / tokens:.2f}): eager / padded graphs " +
                     ", ".join(f"{name} {ratio}" for name, ratio in best.items()))
    lines += ["", "Capture (first call: warm-up, trace where Dynamo, padding check, capture of every size):", ""]
    lines += [f"- {name}: " + ", ".join(f"{k} {v}" for k, v in info.items()) for name, info in capture.items()]
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "extend.json"), "w") as f:
            json.dump({"meta": meta, "ms": results, "rel_error": errors, "capture": capture}, f, indent=2)
        with open(os.path.join(args.out, "extend.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
