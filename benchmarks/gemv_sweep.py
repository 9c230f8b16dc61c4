"""Sweep the Gluon decode kernel's configurations (and check it against dequantize + matmul first).

    PYTHONPATH=src python benchmarks/gemv_sweep.py [--out DIR] [--tokens 1,16] [--shapes 4096x4096,...] [--picked-only]

For M in ``--tokens`` (default 1, 16) and each N×K in ``--shapes`` (default 4096×4096, 8192×8192): CUDA-graph time
per call (weights rotated past L2) of every ``GemvConfig`` in the grid (none with ``--picked-only``), of the
kernel and configuration ``select_config`` picks, of the tl kernel's table pick, and of bf16 cuBLAS. Writes
gemv_sweep.json and gemv_sweep.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvfp4 import graph_ms, rotated_weights  # noqa: E402


CONFIGS = [(8, 1, 1, 1), (8, 1, 1, 2), (8, 1, 2, 1), (8, 1, 2, 2), (8, 2, 1, 1), (8, 2, 1, 2), (4, 1, 1, 2), (4, 1, 2, 2),
           (4, 2, 1, 1), (4, 2, 1, 2), (16, 1, 1, 1), (16, 1, 1, 2), (4, 1, 4, 1), (8, 2, 2, 1), (16, 1, 2, 1),
           (16, 2, 1, 1), (2, 1, 4, 2), (4, 1, 1, 1)]


def check(shapes, dtypes) -> list[dict]:
    from piecewise.kernels.nvfp4 import dequantize, global_scale_for
    from piecewise.kernels.nvfp4.reference import quantize_reference
    from piecewise.kernels.nvfp4.triton_gemm import GemmConfig, pick_gemv_config, sm_count, w4a16_linear

    rows_out = []
    for (m, n, k), dtype, bias_on in itertools.product(shapes, dtypes, (False, True)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        gs = global_scale_for(w)
        packed, scales = quantize_reference(w, gs)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if bias_on else None
        ref_w = dequantize(packed, scales, gs, dtype=torch.float32)
        expected = x.float() @ ref_w.T + (bias.float() if bias is not None else 0)
        config = pick_gemv_config(m, n, k, sm_count(torch.cuda.current_device()))
        got = w4a16_linear(x, packed, scales, torch.reciprocal(gs).reshape(()), bias, config=config)
        tl_out = w4a16_linear(x, packed, scales, torch.reciprocal(gs).reshape(()), bias, config=GemmConfig(16, 64, 128, 4, 3))
        err = float((got.float() - expected).norm() / expected.norm())
        tl_err = float((tl_out.float() - expected).norm() / expected.norm())
        rows_out.append({"M": m, "N": n, "K": k, "dtype": str(dtype), "bias": bias_on, "config": config.__dict__,
                         "rel_error": err, "tl_rel_error": tl_err})
        print(f"check M={m} N={n} K={k} {dtype} bias={bias_on}: gluon {err:.2e} tl {tl_err:.2e}", flush=True)
    return rows_out


def sweep(do_bench, l2_bytes, tokens, shapes, configs=CONFIGS) -> list[dict]:
    from piecewise.kernels.nvfp4.triton_gemm import GemvConfig, pick_config, select_config, sm_count, w4a16_linear

    device = torch.cuda.current_device()
    sms = sm_count(device)

    results = []
    for n, k in shapes:
        weights = rotated_weights(n, l2_bytes, k)
        decode, pc, sc, dense = weights["decode"], weights["packed_copies"], weights["scale_copies"], weights["dense_copies"]
        copies = len(pc)
        for m in tokens:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            bf16 = graph_ms([(lambda i=i: torch.matmul(xs[i % 4], dense[i].T)) for i in range(len(dense))], do_bench)
            tl_ms = graph_ms([(lambda i=i: w4a16_linear(xs[i % 4], pc[i], sc[i], decode,
                                                          config=pick_config(m, n, k, sms))) for i in range(copies)], do_bench)
            picked = select_config(m, n, k, torch.bfloat16, device)
            picked_ms = graph_ms([(lambda i=i: w4a16_linear(xs[i % 4], pc[i], sc[i], decode, config=picked))
                                  for i in range(copies)], do_bench)
            row = {"M": m, "N": n, "K": k, "bf16_ms": bf16, "tl_ms": tl_ms, "picked": str(picked),
                   "picked_ms": picked_ms, "gluon": []}
            for wk, rt, steps, prefetch in configs:
                config = GemvConfig(warps_k=wk, row_tiles=rt, steps=steps, prefetch=prefetch)
                try:
                    ms = graph_ms([(lambda i=i: w4a16_linear(xs[i % 4], pc[i], sc[i], decode, config=config))
                                   for i in range(copies)], do_bench)
                except Exception as exc:  # noqa: BLE001 - a config that does not fit
                    ms = float("inf")
                    print(f"  {config}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                row["gluon"].append({"config": config.__dict__, "ms": ms})
            row["gluon"].sort(key=lambda r: r["ms"])
            floor = (n * k * 9 / 16) / 4.2e12 * 1e3
            results.append(row)
            if not row["gluon"]:
                print(f"M={m} N={n} K={k}: bf16 {bf16 * 1e3:.1f} us, picked {picked_ms * 1e3:.1f} us {picked} "
                      f"({bf16 / picked_ms:.2f}x bf16), tl {tl_ms * 1e3:.1f} us", flush=True)
                continue
            best = row["gluon"][0]
            print(f"M={m} N={n} K={k}: bf16 {bf16 * 1e3:.1f} us, tl {tl_ms * 1e3:.1f} us, picked {picked_ms * 1e3:.1f} us "
                  f"{picked}, floor {floor * 1e3:.1f} us; best gluon "
                  f"{best['ms'] * 1e3:.1f} us {best['config']} ({bf16 / best['ms']:.2f}x bf16, {floor / best['ms']:.0%} roofline)", flush=True)
            for r in row["gluon"][:8]:
                print(f"    {r['ms'] * 1e3:7.1f} us  {r['config']}")
    return results


def markdown(payload: dict, meta: str) -> str:
    errors = ", ".join(sorted({f"{c['rel_error']:.1e}" for c in payload["check"]}))
    lines = ["# Gluon decode kernel: configuration sweep", "", meta, "",
             f"Correctness first (rel. error vs dequantize + matmul, bf16 and fp16, with and without bias): {errors}", ""]
    picked = [r for r in payload.get("sweep", []) if not r["gluon"]]
    if picked:
        lines += ["| M | N | K | bf16 µs | picked µs | × bf16 | tl kernel µs | picked |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['M']} | {r['N']} | {r['K']} | {r['bf16_ms'] * 1e3:.1f} | {r['picked_ms'] * 1e3:.1f} | "
                  f"{r['bf16_ms'] / r['picked_ms']:.2f} | {r['tl_ms'] * 1e3:.1f} | `{r['picked']}` |" for r in picked]
        lines.append("")
    for r in payload.get("sweep", []):
        if not r["gluon"]:
            continue
        lines += [f"## M={r['M']}, N={r['N']}, K={r['K']}: bf16 {r['bf16_ms'] * 1e3:.1f} µs, tl kernel "
                  f"{r['tl_ms'] * 1e3:.1f} µs, picked {r['picked_ms'] * 1e3:.1f} µs (`{r['picked']}`)", "",
                  "| µs | warps on K | rows per warp | steps per iteration | prefetch |", "|---|---|---|---|---|"]
        for g in r["gluon"]:
            c = g["config"]
            lines.append(f"| {g['ms'] * 1e3:.1f} | {c['warps_k']} | {16 * c['row_tiles']} | {c['steps']} | {c['prefetch']} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--quick-check", action="store_true")
    parser.add_argument("--tokens", default="1,16", help="token counts to sweep, comma-separated")
    parser.add_argument("--shapes", default="4096x4096,8192x8192", help="NxK weight shapes, comma-separated")
    parser.add_argument("--picked-only", action="store_true", help="time only the table's pick, tl and bf16")
    args = parser.parse_args()
    from triton.testing import do_bench

    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 0) or 60 * 2**20
    shapes = [(1, 4096, 4096), (3, 256, 1024), (8, 1536, 5120), (9, 4096, 4096), (16, 8192, 8192), (5, 48, 384),
              (1, 2048, 5632), (8, 1536, 1408)][: 2 if args.quick_check else None]
    payload = {"check": check(shapes, (torch.bfloat16, torch.float16))}
    if not args.no_sweep:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
        payload["sweep"] = sweep(do_bench, l2, [int(t) for t in args.tokens.split(",")], shapes,
                                 [] if args.picked_only else CONFIGS)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemv_sweep.json").write_text(json.dumps(payload, indent=2))
        import triton

        import datetime

        meta = (f"- date: {datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                f"triton {triton.__version__}\n"
                f"- command: `python {' '.join(sys.argv)}`\n- CUDA-graph time per call, weights rotated past L2")
        (args.out / "gemv_sweep.md").write_text(markdown(payload, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
