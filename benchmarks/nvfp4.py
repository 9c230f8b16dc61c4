"""NVFP4 kernels on one GPU: quantize bandwidth and the W4A16 GEMM against bf16 matmul and the HBM roofline.

    PYTHONPATH=src python benchmarks/nvfp4.py [--out DIR] [--quick] [--sweep]

Measures the HBM bandwidth first (a large device-to-device copy: bytes read + written / time), then:
- quantize of an [8192, 8192] bf16 tensor (kernel only; the public ``quantize`` adds a host-synchronising value
  check): bytes = read 2·M·K + write M·K/2 + M·K/16;
- the W4A16 GEMM for M in 1..4096, K = N in {4096, 8192}, timed two ways: ``do_bench`` (median, eager launches,
  L2 flushed by do_bench) and a CUDA graph replaying one call per weight copy (no launch overhead). Weights and
  activations rotate over enough copies that L2 (≈60 MB) never holds them. Roofline floor: bytes moved
  (weights N·K/2 + scales N·K/16 + x M·K·2 + out M·N·2) / measured bandwidth.
Targets (pass/fail, graph timings): GEMM ≥ 70% of the roofline at M ≤ 16 and ≥ 2.5x bf16 matmul at M = 1; no
slower than bf16 matmul at M ≥ 1024; quantize ≥ 60% of measured bandwidth. ``--out DIR`` writes nvfp4.json and
nvfp4.md. ``--sweep`` also times a few alternative GEMM configurations at M ≤ 16 (to retune the table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import sys
from pathlib import Path

import torch

M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
SIZES = (4096, 8192)


def measure_bandwidth(do_bench) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write)."""
    numel = 1 << 30
    src = torch.empty(numel, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    del src, dst
    return 2 * numel / (ms * 1e-3)


def copies_for(nbytes: int, l2_bytes: int, minimum: int) -> int:
    return max(minimum, math.ceil(3 * l2_bytes / max(nbytes, 1)))


def graph_ms(calls, do_bench) -> float:
    """Per-call time of a CUDA graph that replays ``calls`` (one per rotated copy) back to back."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / len(calls)
    del graph
    return ms


def rotating(calls):
    state = {"i": 0}

    def step():
        call = calls[state["i"] % len(calls)]
        state["i"] += 1
        return call()

    return step


def bench_quantize(do_bench, bandwidth: float, quick: bool) -> list[dict]:
    from piecewise.kernels.nvfp4 import global_scale_for
    from piecewise.kernels.nvfp4.triton_quant import quantize_triton

    rows = cols = 4096 if quick else 8192
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    gs = global_scale_for(x)
    nbytes = rows * cols * 2 + rows * cols // 2 + rows * cols // 16
    results = []
    for swizzle in (False, True):
        ms = do_bench(lambda: quantize_triton(x, gs, swizzle), warmup=25, rep=200, return_mode="median")
        gbps = nbytes / (ms * 1e-3)
        results.append({"shape": [rows, cols], "swizzle": swizzle, "ms": ms, "GBps": gbps / 1e9,
                        "fraction_of_hbm": gbps / bandwidth})
    return results


def rotated_weights(size: int, l2_bytes: int, k: int | None = None) -> dict:
    """A random size×k weight (k defaults to size), NVFP4-quantized by the reference (torch ops on the GPU: no dependence on the
    kernels), with enough copies of it (and of its bf16 original) that rotating through them misses L2, and its
    dequantized float32 values for checks."""
    from piecewise.kernels.nvfp4 import global_scale_for
    from piecewise.kernels.nvfp4.reference import quantize_reference

    weight = torch.randn(size, k or size, device="cuda", dtype=torch.bfloat16) * 0.02
    gs = global_scale_for(weight)
    packed, scales = quantize_reference(weight, gs)
    copies = copies_for(packed.numel() + scales.numel(), l2_bytes, 8)
    return {"packed": packed, "scales": scales, "decode": torch.reciprocal(gs).reshape(()),
            "packed_copies": [packed.clone() for _ in range(copies)], "scale_copies": [scales.clone() for _ in range(copies)],
            "dense_copies": [weight.clone() for _ in range(copies_for(weight.numel() * 2, l2_bytes, 2))],
            "reference": _dequantized(packed, scales, gs)}


def bench_gemm(do_bench, bandwidth: float, l2_bytes: int, size: int, m_values, sweep: bool) -> list[dict]:
    from piecewise.kernels.nvfp4.triton_gemm import GemmConfig, w4a16_linear

    n = k = size
    weight_bytes = n * k // 2 + n * k // 16
    w = rotated_weights(size, l2_bytes)
    decode, packed_copies, scale_copies = w["decode"], w["packed_copies"], w["scale_copies"]
    dense_copies, reference_weight = w["dense_copies"], w["reference"]
    copies = len(packed_copies)
    results = []
    for m in m_values:
        x_copies = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(min(copies, 8))]
        ours = [
            (lambda i=i: w4a16_linear(x_copies[i % len(x_copies)], packed_copies[i], scale_copies[i], decode))
            for i in range(copies)
        ]
        dense = [
            (lambda i=i: torch.matmul(x_copies[i % len(x_copies)], dense_copies[i].T))
            for i in range(len(dense_copies))
        ]
        expected = x_copies[0].float() @ reference_weight.T
        error = float((ours[0]().float() - expected).norm() / expected.norm())
        row = {
            "M": m, "N": n, "K": k, "rel_error": error,
            "config": kernel_config(m, n, k),
            "ours_ms": do_bench(rotating(ours), warmup=25, rep=100, return_mode="median"),
            "ours_graph_ms": graph_ms(ours, do_bench),
            "bf16_ms": do_bench(rotating(dense), warmup=25, rep=100, return_mode="median"),
            "bf16_graph_ms": graph_ms(dense, do_bench),
        }
        floor_bytes = weight_bytes + m * k * 2 + m * n * 2
        row["floor_bytes"] = floor_bytes
        row["floor_ms"] = floor_bytes / bandwidth * 1e3
        row["roofline_fraction"] = row["floor_ms"] / row["ours_graph_ms"]
        row["tflops"] = 2 * m * n * k / (row["ours_graph_ms"] * 1e-3) / 1e12
        row["speedup_vs_bf16"] = row["bf16_graph_ms"] / row["ours_graph_ms"]
        if sweep and m <= 16:
            candidates = [
                GemmConfig(16, n_block, k_block, warps, stages, split)
                for n_block, k_block, warps, stages in ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (128, 256, 8, 3))
                for split in (1, 2, 4, 8, 16)
            ]
            timings = []
            for config in candidates:
                calls = [
                    (lambda i=i, c=config: w4a16_linear(x_copies[i % len(x_copies)], packed_copies[i], scale_copies[i], decode, config=c))
                    for i in range(copies)
                ]
                try:
                    timings.append((graph_ms(calls, do_bench), config.__dict__))
                except Exception as exc:  # a configuration that does not fit (shared memory, registers)
                    timings.append((float("inf"), {**config.__dict__, "error": type(exc).__name__}))
            timings.sort(key=lambda item: item[0])
            row["sweep_best"] = [{"ms": ms, "config": config} for ms, config in timings[:3]]
        results.append(row)
        del x_copies, ours, dense
    return results


def kernel_config(m: int, n: int, k: int) -> dict:
    """What ``w4a16_linear`` launches for bf16 x [m, k] and W [n, k], for the report."""
    from piecewise.kernels.nvfp4.gluon_gemv import GemvConfig, PrefillConfig, WgmmaConfig
    from piecewise.kernels.nvfp4.triton_gemm import select_config

    config = select_config(m, n, k, torch.bfloat16, torch.cuda.current_device())
    if config is None:
        return {"path": "dequantize + cuBLAS"}
    path = ("gluon" if isinstance(config, GemvConfig) else "gluon wgmma" if isinstance(config, WgmmaConfig)
            else "gluon prefill" if isinstance(config, PrefillConfig) else "tl")
    return {"path": path, **config.__dict__}


def config_text(c: dict) -> str:
    if c["path"] == "gluon":
        return f"gluon mma.sync, {c['warps_k']} warps on K, {16 * c['row_tiles']} rows/warp"
    if c["path"] == "gluon wgmma":
        split = f", K split in {c['split_k']}" if c.get("split_k", 1) > 1 else ""
        return f"gluon wgmma, {16 * c['warps']} rows x {c['block_m']} tokens, {128 * c['steps']} k/iteration{split}"
    if c["path"] == "gluon prefill":
        return f"gluon prefill, {c['block_m']} tokens x {c['block_n']} rows"
    if c["path"] == "tl" or "block_k" in c:
        return f"tl {c['block_m']}x{c['block_n']}x{c['block_k']} w{c['num_warps']} s{c['num_stages']} split{c['split_k']}"
    return c["path"]


def _dequantized(packed, scales, gs):
    from piecewise.kernels.nvfp4 import dequantize

    return dequantize(packed, scales, gs, dtype=torch.float32)


def check_targets(quantize_rows: list[dict], gemm_rows: list[dict]) -> list[tuple[str, bool, str]]:
    checks = []
    for row in gemm_rows:
        case = f"M={row['M']} K=N={row['K']}"
        if row["M"] <= 16:
            fraction = row["roofline_fraction"]
            checks.append((f"GEMM {case} ≥ 70% of HBM roofline", fraction >= 0.70, f"{fraction:.0%}"))
        if row["M"] == 1:
            checks.append((f"GEMM {case} ≥ 2.5x bf16 matmul", row["speedup_vs_bf16"] >= 2.5, f"{row['speedup_vs_bf16']:.2f}x"))
        if row["M"] >= 1024:
            checks.append((f"GEMM {case} no slower than bf16 matmul", row["speedup_vs_bf16"] >= 1.0, f"{row['speedup_vs_bf16']:.2f}x"))
        checks.append((f"GEMM {case} matches dequantize+matmul (rel ≤ 1e-2)", row["rel_error"] <= 1e-2, f"{row['rel_error']:.1e}"))
    for row in quantize_rows:
        name = f"quantize {row['shape'][0]}x{row['shape'][1]} swizzle={row['swizzle']} ≥ 60% of HBM"
        checks.append((name, row["fraction_of_hbm"] >= 0.60, f"{row['fraction_of_hbm']:.0%}"))
    return checks


def markdown(meta: dict, bandwidth: float, quantize_rows, gemm_rows, checks) -> str:
    lines = [
        "# NVFP4 kernels", "",
        f"- date: {meta['date']}", f"- GPU: {meta['gpu']}", f"- torch {meta['torch']}, triton {meta['triton']}",
        f"- command: `{meta['command']}`", f"- measured HBM bandwidth (copy, read+write): {bandwidth / 1e9:.0f} GB/s", "",
        "## Quantize", "", "| shape | swizzle | ms | GB/s | of HBM |", "|---|---|---|---|---|",
    ]
    for r in quantize_rows:
        lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['swizzle']} | {r['ms']:.3f} | {r['GBps']:.0f} | {r['fraction_of_hbm']:.0%} |")
    lines += [
        "", "## W4A16 GEMM (graph = CUDA-graph replay per call; eager = do_bench median)", "",
        "| M | K=N | ours graph ms | ours eager ms | bf16 graph ms | bf16 eager ms | floor ms | of roofline | TFLOP/s | vs bf16 | config |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in gemm_rows:
        config = config_text(r["config"])
        lines.append(
            f"| {r['M']} | {r['K']} | {r['ours_graph_ms']:.4f} | {r['ours_ms']:.4f} | {r['bf16_graph_ms']:.4f} | "
            f"{r['bf16_ms']:.4f} | {r['floor_ms']:.4f} | {r['roofline_fraction']:.0%} | {r['tflops']:.1f} | "
            f"{r['speedup_vs_bf16']:.2f}x | {config} |"
        )
    lines += ["", "## Targets", "", "| check | result | value |", "|---|---|---|"]
    lines += [f"| {name} | {'PASS' if ok else 'FAIL'} | {value} |" for name, ok, value in checks]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for nvfp4.json and nvfp4.md")
    parser.add_argument("--quick", action="store_true", help="fewer sizes (K=N=4096, M in 1, 16, 1024)")
    parser.add_argument("--sweep", action="store_true", help="also time alternative GEMM configs at M ≤ 16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/nvfp4.py needs a CUDA GPU (it times Triton kernels); none is visible here.", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2_bytes = getattr(props, "L2_cache_size", 0) or 60 * 2**20
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__,
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "l2_bytes": l2_bytes,
    }
    bandwidth = measure_bandwidth(do_bench)
    print(f"{meta['gpu']}: measured HBM bandwidth {bandwidth / 1e9:.0f} GB/s (copy, read+write)", flush=True)
    quantize_rows = bench_quantize(do_bench, bandwidth, args.quick)
    gemm_rows = []
    for size in SIZES[:1] if args.quick else SIZES:
        m_values = (1, 16, 1024) if args.quick else M_VALUES
        gemm_rows += bench_gemm(do_bench, bandwidth, l2_bytes, size, m_values, args.sweep)
        print(f"GEMM K=N={size} done", flush=True)
    checks = check_targets(quantize_rows, gemm_rows)
    report = markdown(meta, bandwidth, quantize_rows, gemm_rows, checks)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"meta": meta, "hbm_bytes_per_s": bandwidth, "quantize": quantize_rows, "gemm": gemm_rows,
                   "checks": [{"check": n, "pass": ok, "value": v} for n, ok, v in checks]}
        (args.out / "nvfp4.json").write_text(json.dumps(payload, indent=2))
        (args.out / "nvfp4.md").write_text(report)
    sweeps = [r for r in gemm_rows if "sweep_best" in r]
    for r in sweeps:
        print(f"sweep M={r['M']} K=N={r['K']}: " + "; ".join(f"{b['ms']:.4f} ms {b['config']}" for b in r["sweep_best"]))
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
