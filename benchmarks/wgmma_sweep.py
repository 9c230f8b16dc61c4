"""Sweep the Gluon wgmma kernel's configurations (33..255 tokens) against the other paths.

    PYTHONPATH=src python benchmarks/wgmma_sweep.py [--out DIR] [--tokens 40,64,96,128,160,192,224]
        [--shapes 4096x4096,8192x8192] [--split]

For each token count and layer shape N×K: CUDA-graph time per call (weights rotated past L2) of every
``WgmmaConfig`` in the grid (each checked against dequantize + matmul first), of what ``w4a16_linear`` picks
today, of the tl kernel's table pick and of bf16 cuBLAS. ``--split`` adds split-K variants of the grid.
Writes wgmma_sweep.json and wgmma_sweep.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvfp4 import config_text, graph_ms, kernel_config, rotated_weights  # noqa: E402

CONFIGS = [(32, 4, 2), (16, 4, 2), (32, 4, 1), (64, 4, 1), (128, 4, 1), (32, 8, 1), (64, 8, 1), (128, 8, 1), (32, 8, 2)]
SPLIT_CONFIGS = [(32, 4, 2, 2), (32, 4, 2, 4), (32, 4, 2, 8), (64, 4, 1, 2), (64, 4, 1, 4), (64, 4, 1, 8),
                 (64, 8, 1, 2), (64, 8, 1, 4), (128, 8, 1, 2), (128, 8, 1, 4), (128, 4, 1, 2), (128, 4, 1, 4)]


def sweep(do_bench, l2_bytes, tokens, shapes, configs) -> list[dict]:
    from piecewise.kernels.nvfp4.triton_gemm import WgmmaConfig, pick_config, sm_count, w4a16_linear

    sms = sm_count(torch.cuda.current_device())
    results = []
    for n, k in shapes:
        weights = rotated_weights(n, l2_bytes, k)
        packed, scales, decode = weights["packed"], weights["scales"], weights["decode"]
        pc, sc, dense, ref_w = weights["packed_copies"], weights["scale_copies"], weights["dense_copies"], weights["reference"]
        copies = len(pc)
        for m in tokens:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            expected = xs[0].float() @ ref_w.T

            def timed(config):
                return graph_ms([(lambda i=i: w4a16_linear(xs[i % 4], pc[i], sc[i], decode, config=config))
                                 for i in range(copies)], do_bench)

            row = {"M": m, "N": n, "K": k,
                   "bf16_ms": graph_ms([(lambda i=i: torch.matmul(xs[i % 4], dense[i].T)) for i in range(len(dense))], do_bench),
                   "picked": config_text(kernel_config(m, n, k)), "picked_ms": timed(None),
                   "tl_ms": timed(pick_config(m, n, k, sms)), "wgmma": []}
            for values in configs:
                config = WgmmaConfig(*values)
                got = w4a16_linear(xs[0], packed, scales, decode, config=config)
                err = float((got.float() - expected).norm() / expected.norm())
                ms = timed(config) if err <= 1e-2 else float("inf")
                row["wgmma"].append({"config": config.__dict__, "ms": ms, "rel_error": err})
            row["wgmma"].sort(key=lambda r: r["ms"])
            best = row["wgmma"][0]
            print(f"M={m} N={n} K={k}: bf16 {row['bf16_ms'] * 1e3:.1f} us, picked {row['picked_ms'] * 1e3:.1f} us "
                  f"({row['picked']}), tl {row['tl_ms'] * 1e3:.1f} us; best wgmma {best['ms'] * 1e3:.1f} us "
                  f"{best['config']}", flush=True)
            results.append(row)
    return results


def _key(config: dict) -> tuple:
    return (config["block_m"], config["warps"], config["steps"], config.get("split_k", 1))


def markdown(rows: list[dict], meta: str, configs) -> str:
    lines = ["# Gluon wgmma kernel: configuration sweep", "", meta, "",
             "µs per call; configurations as tokens per program × warps (16 weight rows each) × 128-code steps per "
             "iteration (× programs splitting K). Every configuration was checked against dequantize + matmul first (rel. error ≤ 1e-2; "
             "errors: " + ", ".join(sorted({f"{w['rel_error']:.1e}" for r in rows for w in r["wgmma"]})) + ").", ""]
    keys = [tuple(c) + (1,) * (4 - len(c)) for c in configs]
    names = [f"{b}×{w}×{s}" + (f"×{k}" if k > 1 else "") for b, w, s, k in keys]
    lines += ["| M | N×K | bf16 | picked | tl | " + " | ".join(names) + " |", "|---" * (5 + len(names)) + "|"]
    for r in rows:
        by = {_key(w["config"]): w["ms"] for w in r["wgmma"]}
        best = min(by.values())
        cells = [(f"**{by[c] * 1e3:.1f}**" if by[c] == best else f"{by[c] * 1e3:.1f}") for c in keys]
        lines.append(f"| {r['M']} | {r['N']}×{r['K']} | {r['bf16_ms'] * 1e3:.1f} | {r['picked_ms'] * 1e3:.1f} "
                     f"({r['picked']}) | {r['tl_ms'] * 1e3:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tokens", default="40,64,96,128,160,192,224", help="token counts, comma-separated")
    parser.add_argument("--shapes", default="4096x4096,8192x8192", help="N x K layer shapes, comma-separated")
    parser.add_argument("--split", action="store_true", help="also the split-K variants")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    configs = CONFIGS + (SPLIT_CONFIGS if args.split else [])
    from triton.testing import do_bench
    import triton

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 60 * 2**20
    rows = sweep(do_bench, l2, [int(t) for t in args.tokens.split(",")], shapes, configs)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "wgmma_sweep.json").write_text(json.dumps(rows, indent=2))
        meta = (f"- date: {datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                f"triton {triton.__version__}\n- command: `python {' '.join(sys.argv)}`\n"
                "- CUDA-graph time per call, weights rotated past L2")
        (args.out / "wgmma_sweep.md").write_text(markdown(rows, meta, configs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
