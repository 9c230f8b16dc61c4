"""W4A16 at prefill token counts on Hopper: the Gluon prefill kernel against the other ways to run it.

    PYTHONPATH=src python benchmarks/nvfp4_prefill.py --out DIR [--tokens 256,512,1024,4096]

For each layer shape and token count, CUDA-graph time per call (``nvfp4.graph_ms``: weights rotated over enough
copies that L2 never holds them) of:
- bf16 activations: cuBLAS on bf16 weights (the reference), dequantize + cuBLAS (what ``w4a16_linear`` runs for
  bf16 from 256 tokens), the prefill kernel;
- fp16 activations: cuBLAS on fp16 weights, the tl kernel (what fp16 ran before), the prefill kernel (what it
  runs now on sm_90).
Writes nvfp4_prefill.json and nvfp4_prefill.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvfp4 import copies_for, graph_ms  # noqa: E402

SHAPES = ((4096, 4096), (8192, 8192), (28672, 4096), (4096, 14336))  # (N, K): square, Llama-70B MLP up / down


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tokens", default="256,512,1024,4096")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    import triton
    from triton.testing import do_bench

    from piecewise.kernels.nvfp4 import global_scale_for, gluon_gemv
    from piecewise.kernels.nvfp4.reference import quantize_reference
    from piecewise.kernels.nvfp4.triton_gemm import _dense_linear, pick_config, select_config, sm_count, w4a16_linear

    if not gluon_gemv.PREFILL_AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        print("the prefill kernel needs Gluon and an sm_90 GPU")
        return 1
    sms = sm_count(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        gs = global_scale_for(w)
        packed, scales = quantize_reference(w, gs)
        decode = torch.reciprocal(gs).reshape(())
        copies = copies_for(n * k // 2 + n * k // 16, l2, 4)
        pc = [packed.clone() for _ in range(copies)]
        sc = [scales.clone() for _ in range(copies)]
        dense_copies = copies_for(n * k * 2, l2, 2)
        dense = {dt: [w.to(dt) for _ in range(dense_copies)] for dt in (torch.bfloat16, torch.float16)}
        del w
        for m in tokens:
            row = {"N": n, "K": k, "M": m}
            for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
                xs = [torch.randn(m, k, device="cuda", dtype=dt) for _ in range(2)]
                row[f"{name}_cublas"] = graph_ms(
                    [(lambda i=i: torch.matmul(xs[i % 2], dense[dt][i].T)) for i in range(dense_copies)], do_bench)
                config = gluon_gemv.pick_prefill_config(m, n, sms)
                row[f"{name}_prefill"] = graph_ms(
                    [(lambda i=i: w4a16_linear(xs[i % 2], pc[i], sc[i], decode, config=config)) for i in range(copies)],
                    do_bench)
                row["config"] = f"{config.block_m}x{config.block_n}"
                if dt == torch.bfloat16:
                    u8 = [s.view(torch.uint8) for s in sc]
                    row["bf16_dequant_cublas"] = graph_ms(
                        [(lambda i=i: _dense_linear(xs[i % 2], pc[i], u8[i], decode, None)) for i in range(copies)],
                        do_bench)
                else:
                    tl = pick_config(m, n, k, sms)
                    row["fp16_tl"] = graph_ms(
                        [(lambda i=i: w4a16_linear(xs[i % 2], pc[i], sc[i], decode, config=tl)) for i in range(copies)],
                        do_bench)
                del xs
            row["bf16_default"] = "dequant+cuBLAS" if select_config(m, n, k, torch.bfloat16, 0) is None else "prefill"
            rows.append(row)
            print(f"N={n} K={k} M={m}: " + " ".join(
                f"{key} {value * 1e3:.1f}" for key, value in row.items() if isinstance(value, float)), flush=True)
        del pc, sc, dense
        torch.cuda.empty_cache()

    header = [
        "# W4A16 at prefill token counts (µs per call, CUDA-graph replay)", "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- GPU: {torch.cuda.get_device_name()}",
        f"- torch {torch.__version__}, triton {triton.__version__}",
        f"- command: `python benchmarks/nvfp4_prefill.py {shlex.join(argv if argv is not None else sys.argv[1:])}`", "",
        "| N | K | M | bf16 cuBLAS | bf16 dequantize + cuBLAS | bf16 prefill kernel | prefill vs cuBLAS "
        "| fp16 cuBLAS | fp16 tl kernel | fp16 prefill kernel | prefill vs tl | config |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines = [
        f"| {r['N']} | {r['K']} | {r['M']} | {r['bf16_cublas'] * 1e3:.1f} | {r['bf16_dequant_cublas'] * 1e3:.1f} "
        f"| {r['bf16_prefill'] * 1e3:.1f} | {r['bf16_cublas'] / r['bf16_prefill']:.2f}x | {r['fp16_cublas'] * 1e3:.1f} "
        f"| {r['fp16_tl'] * 1e3:.1f} | {r['fp16_prefill'] * 1e3:.1f} | {r['fp16_tl'] / r['fp16_prefill']:.2f}x "
        f"| {r['config']} |"
        for r in rows
    ]
    text = "\n".join(header + lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "nvfp4_prefill.json").write_text(json.dumps(rows, indent=1))
        (args.out / "nvfp4_prefill.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
