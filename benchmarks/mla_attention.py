"""MLA attention over a latent KV cache (``piecewise.kernels.mla``) at GLM-5 shapes: 64 heads, R=512, P=64, bf16.

    PYTHONPATH=src python benchmarks/mla_attention.py --out DIR [--sweep] [--batch 1,8,32,128] [--context 2048,8192]

Decode of B sequences (one token each, at the cache's last position), sparse over 2048 random distinct picks
and dense over the whole context; a prefill of 2048 tokens of one sequence over 2048 picks each (token t picks
its t + 1 rows, the rest -1). Times are per call, the median of CUDA graph replays of one call per copy of the
cache, with enough copies that L2 never holds them. Bytes: the visible picked rows × (R + P) × 2 + q + out,
over the H200's 4.8 TB/s and over the copy bandwidth measured first. ``--sweep`` first times the candidate
block sizes (``CANDIDATES``) and splits at B ∈ {32, 128}, context 2048, sparse and dense, then runs the table
with the fastest at B=32 sparse (without it: ``BLOCKS``, the default). ``--out DIR`` writes mla_attention.json
and mla_attention.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import multiprocessing
import os
import sys
from pathlib import Path

import torch

from piecewise.kernels import latent_fp8
from piecewise.kernels.mla import BLOCKS, LatentBlocks, latent_attention, latent_attention_reference, latent_splits

HEADS, LATENT, ROPE, PICKS = 64, 512, 64, 2048
SCALE = (192 + ROPE) ** -0.5
HBM_BYTES_PER_S = 4.8e12
FP8 = os.environ.get("PIECEWISE_MLA_FP8") == "1"
"""``--fp8``: the cache holds FP8 rows (``kernels.latent_fp8``, 656 bytes a row); read by the warm-up processes too."""
CANDIDATES = [LatentBlocks(64, 32, 8, 5, False, 3), LatentBlocks(64, 32, 8, 6, False, 4),
              LatentBlocks(64, 64, 8, 3, False, 2), LatentBlocks(32, 32, 8, 5, False, 3),
              LatentBlocks(32, 32, 4, 5, False, 3), LatentBlocks(32, 64, 4, 4, False, 3),
              LatentBlocks(16, 32, 4, 5, False, 3), LatentBlocks(64, 32, 8, 4, True, 4)]
"""Block sizes the sweep times: the default first, then more stages, 64 rows a step, 32 or 16 heads (two or four
programs a token, each row read once per program) and rows_first (the queries as the right-hand operand); none
beat the default on the 2026-12-02 sweep (``results/2026-12-02-h200-mla-attention-sweep.md``). Built for sm_90 by
Triton 3.6 the default takes 181 KB of shared memory (one program a multiprocessor; 244 registers)."""
SWEEP_SPLITS = {32: (4, 8, 16), 128: (1, 2)}
"""Splits timed per batch size."""


def make_case(batch: int, context: int, sparse: bool, prefill: bool = False, seed: int = 0) -> dict:
    """Inputs of one call; ``rows`` counts the visible picks (the rows the call must read)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    sequences = 1 if prefill else batch
    tokens = context if prefill else batch
    cache = torch.randn(sequences, context, LATENT + ROPE, device="cuda", generator=generator).to(torch.bfloat16)
    positions = torch.arange(tokens, device="cuda") if prefill else torch.full((tokens,), context - 1, device="cuda")
    slots = torch.zeros(tokens, dtype=torch.long, device="cuda") if prefill else torch.arange(tokens, device="cuda")
    q_latent = torch.randn(tokens, HEADS, LATENT, device="cuda", generator=generator).to(torch.bfloat16)
    q_rope = torch.randn(tokens, HEADS, ROPE, device="cuda", generator=generator).to(torch.bfloat16)
    indices = None
    if sparse:
        keys = torch.rand(tokens, context, device="cuda", generator=generator)
        keys = keys.masked_fill(torch.arange(context, device="cuda")[None, :] > positions[:, None], -1.0)
        top = keys.topk(min(PICKS, context), dim=1)
        indices = torch.where(top.values >= 0, top.indices, -1)  # distinct random picks ≤ position, then -1
    rows = int((indices >= 0).sum()) if sparse else int((positions + 1).sum())
    if FP8:
        cache = latent_fp8.quantize_rows(cache[..., :LATENT], cache[..., LATENT:])
    return dict(q_latent=q_latent, q_rope=q_rope, cache=cache, slots=slots, positions=positions, indices=indices,
                rows=rows, tokens=tokens)


def bytes_read(case: dict) -> int:
    row = latent_fp8.row_bytes(LATENT, ROPE) if FP8 else (LATENT + ROPE) * 2
    return case["rows"] * row + case["tokens"] * HEADS * (LATENT + ROPE + LATENT) * 2


def flops(case: dict) -> int:
    return case["rows"] * HEADS * 2 * (LATENT + ROPE + LATENT)


def time_us(case: dict, do_bench, graph_ms, l2_bytes: int, blocks=None, splits=None) -> float:
    from nvfp4 import copies_for

    copies = copies_for(case["cache"].numel() * case["cache"].element_size(), l2_bytes, 2)
    caches = [case["cache"]] + [case["cache"].clone() for _ in range(copies - 1)]
    calls = [lambda cache=cache: latent_attention(case["q_latent"], case["q_rope"], cache, case["slots"],
                                                  case["positions"], SCALE, case["indices"], splits, blocks=blocks)
             for cache in caches]
    us = graph_ms(calls, do_bench) * 1e3
    del caches, calls
    return us


def rel_error(case: dict, blocks=None, splits=None) -> float:
    out = latent_attention(case["q_latent"], case["q_rope"], case["cache"], case["slots"], case["positions"], SCALE,
                           case["indices"], splits, blocks=blocks).float()
    cache = case["cache"] if FP8 else case["cache"].float()
    expected = latent_attention_reference(case["q_latent"].float(), case["q_rope"].float(), cache,
                                          case["slots"], case["positions"], SCALE, case["indices"])
    return float((out - expected).norm() / expected.norm())


def _warm(job: tuple) -> str:
    """Compile one variant in a worker process (Triton's disk cache then serves the timing process)."""
    blocks, batch, context, sparse, prefill, splits = job
    case = make_case(batch if not prefill else 2048, context, sparse, prefill)
    try:
        latent_attention(case["q_latent"], case["q_rope"], case["cache"], case["slots"], case["positions"], SCALE,
                         case["indices"], splits, blocks=blocks)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a candidate that does not fit: the sweep records it
        return f"{job}: {type(exc).__name__}"
    return ""


def warm(jobs: list[tuple]) -> None:
    with concurrent.futures.ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = [message for message in pool.map(_warm, jobs) if message]
    print(f"compiled {len(jobs)} variants", *failed, sep="\n", flush=True)


def sweep(do_bench, graph_ms, l2_bytes: int) -> list[dict]:
    rows = []
    for batch, split_options in SWEEP_SPLITS.items():
        for sparse in (True, False):
            case = make_case(batch, 2048, sparse)
            for blocks in CANDIDATES:
                for splits in split_options:
                    row = {"batch": batch, "mode": "sparse" if sparse else "dense",
                           "blocks": dataclasses.asdict(blocks), "splits": splits}
                    try:
                        row["us"] = time_us(case, do_bench, graph_ms, l2_bytes, blocks, splits)
                        row["of_hbm"] = bytes_read(case) / (row["us"] * 1e-6) / HBM_BYTES_PER_S
                        timed = f"{row['us']:.1f} µs, {row['of_hbm']:.0%} of HBM"
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory on this Triton
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                        timed = row["error"]
                    rows.append(row)
                    print(f"sweep B={batch} {row['mode']} {blocks} splits={splits}: {timed}", flush=True)
            del case
    return rows


def best_blocks(sweep_rows: list[dict]) -> LatentBlocks:
    """The fastest candidate at B=32 sparse (its best split) among those that also ran dense at B=32."""
    ran_dense = {str(r["blocks"]) for r in sweep_rows if r["mode"] == "dense" and "us" in r}
    timed = [r for r in sweep_rows if r["batch"] == 32 and r["mode"] == "sparse" and "us" in r
             and str(r["blocks"]) in ran_dense]
    return LatentBlocks(**min(timed, key=lambda r: r["us"])["blocks"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch", default="1,8,32,128")
    parser.add_argument("--context", default="2048,8192")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--fp8", action="store_true", help="FP8 rows (kernels.latent_fp8) instead of bf16")
    args = parser.parse_args()
    if args.fp8:
        global FP8
        FP8 = True
        os.environ["PIECEWISE_MLA_FP8"] = "1"
    from triton.testing import do_bench

    sys.path.insert(0, str(Path(__file__).parent))
    from nvfp4 import graph_ms, measure_bandwidth

    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 0) or 60 * 2**20
    bandwidth = measure_bandwidth(do_bench)
    batches = [int(b) for b in args.batch.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    jobs = [(None, b, c, s, False, None) for c in contexts for b in batches for s in (True, False)]
    jobs += [(None, 2048, 2048, True, True, None)]  # the table's, when it runs the default blocks
    if args.sweep:
        jobs += [(blocks, b, 2048, sparse, False, s) for blocks in CANDIDATES for b in SWEEP_SPLITS
                 for s in SWEEP_SPLITS[b] for sparse in (True, False)]
    warm(jobs)
    sweep_rows = sweep(do_bench, graph_ms, l2_bytes) if args.sweep else []
    blocks = best_blocks(sweep_rows) if sweep_rows else BLOCKS[torch.bfloat16]
    print("table with", blocks, flush=True)
    rows = []
    for name, batch, context, sparse, prefill in (
            [("decode", b, c, s, False) for c in contexts for b in batches for s in (True, False)]
            + [("prefill", 2048, 2048, True, True)]):
        case = make_case(batch, context, sparse, prefill)
        splits = latent_splits(case["tokens"], -(-HEADS // blocks.heads), PICKS if sparse else context,
                               case["cache"].device)
        us = time_us(case, do_bench, graph_ms, l2_bytes, blocks)
        nbytes = bytes_read(case)
        rows.append(dict(kind=name, batch=1 if prefill else batch, tokens=case["tokens"], context=context,
                         mode="sparse" if sparse else "dense", splits=splits, us=us, bytes=nbytes,
                         GBps=nbytes / (us * 1e-6) / 1e9, of_hbm=nbytes / (us * 1e-6) / HBM_BYTES_PER_S,
                         of_copy=nbytes / (us * 1e-6) / bandwidth, TFLOPs=flops(case) / (us * 1e-6) / 1e12,
                         rel_error=rel_error(case, blocks)))
        print(rows[-1], flush=True)
        del case
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "device": torch.cuda.get_device_name(),
            "copy_bandwidth_GBps": round(bandwidth / 1e9), "blocks": dataclasses.asdict(blocks),
            "command": "PYTHONPATH=src python benchmarks/mla_attention.py " + " ".join(sys.argv[1:])}
    row = latent_fp8.row_bytes(LATENT, ROPE) if FP8 else (LATENT + ROPE) * 2  # bytes a cache row
    lines = ["# MLA attention over a latent cache (GLM-5: 64 heads, R=512, P=64, bf16)", "",
             *(f"- {k}: {v}" for k, v in meta.items()), "",
             f"µs per call (CUDA graph replay, median); bytes = visible picked rows × {row} + q + out; "
             "% of 4.8 TB/s and of the measured copy bandwidth", "",
             ("| kind | B | tokens | context | mode | splits | µs | MB read | GB/s | of 4.8 TB/s | of copy | TFLOP/s "
              "| rel. error |"), "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['batch']} | {r['tokens']} | {r['context']} | {r['mode']} | {r['splits']} | "
              f"{r['us']:.1f} | {r['bytes'] / 1e6:.1f} | {r['GBps']:.0f} | {r['of_hbm']:.0%} | {r['of_copy']:.0%} | "
              f"{r['TFLOPs']:.0f} | {r['rel_error']:.1e} |" for r in rows]
    if sweep_rows:
        lines += ["", "Sweep (context 2048): µs per call and share of 4.8 TB/s", "",
                  "| B | mode | heads | rows | warps | stages | rows_first | dense_stages | splits | µs "
                  "| of 4.8 TB/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['mode']} | {r['blocks']['heads']} | {r['blocks']['rows']} | "
                  f"{r['blocks']['warps']} | {r['blocks']['stages']} | {r['blocks']['rows_first']} | "
                  f"{r['blocks']['dense_stages']} | {r['splits']} | "
                  + (f"{r['us']:.1f} | {r['of_hbm']:.0%} |" if "us" in r else f"{r['error']} | |") for r in sweep_rows]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mla_attention.json").write_text(json.dumps({"meta": meta, "rows": rows, "sweep": sweep_rows},
                                                                 indent=2))
        (args.out / "mla_attention.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
