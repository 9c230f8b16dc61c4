"""Attention of B decoding sequences over a multi-sequence KV cache (``piecewise.kernels.attention``): the Triton
kernel with its split of the keys as ``key_splits`` picks it and without, against the per-sequence PyTorch
reference, GLM-4.5-Air heads (96 query, 8 KV, head_dim 128), bf16.

    PYTHONPATH=src python benchmarks/slot_attention.py --out DIR [--batch 1,8,32] [--context 512,4096,32768]

Kernel times are per call inside a CUDA graph (the op runs between pieces, so launch cost is not in them); the
reference is host-inclusive (it syncs per sequence). "of HBM" is the K/V bytes each call must read over the
measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from piecewise.kernels.attention import key_splits, slot_attention, slot_attention_reference

Q_HEADS, KV_HEADS, HEAD_DIM = 96, 8, 128


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--context", default="512,4096,32768")
    args = parser.parse_args()
    from triton.testing import do_bench

    sys.path.insert(0, str(Path(__file__).parent))
    from nvfp4 import graph_ms, measure_bandwidth

    bandwidth = measure_bandwidth(do_bench)
    rows = []
    for context in (int(c) for c in args.context.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            cache_k = torch.randn(batch, context, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            cache_v = torch.randn_like(cache_k)
            q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            slots = torch.arange(batch, device="cuda")
            positions = torch.full((batch,), context - 1, device="cuda")
            scale = HEAD_DIM**-0.5
            splits = key_splits(batch, KV_HEADS, context, q.device)
            expected = slot_attention_reference(q.float(), cache_k.float(), cache_v.float(), slots, positions, scale)
            error = float((slot_attention(q, cache_k, cache_v, slots, positions, scale).float() - expected).norm()
                          / expected.norm())
            split_us = graph_ms([lambda: slot_attention(q, cache_k, cache_v, slots, positions, scale)], do_bench) * 1e3
            single_us = graph_ms([lambda: slot_attention(q, cache_k, cache_v, slots, positions, scale, splits=1)],
                                 do_bench) * 1e3
            reference_us = do_bench(lambda: slot_attention_reference(q, cache_k, cache_v, slots, positions, scale),
                                    warmup=5, rep=50, return_mode="median") * 1e3
            floor_us = 2 * cache_k.numel() * cache_k.element_size() / bandwidth * 1e6
            rows.append(dict(context=context, batch=batch, splits=splits, kernel_us=split_us, one_split_us=single_us,
                             reference_us=reference_us, hbm_floor_us=floor_us, rel_error=error))
            print(rows[-1], flush=True)
            del cache_k, cache_v
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(), "bandwidth_GBps": round(bandwidth / 1e9),
            "command": "PYTHONPATH=src python benchmarks/slot_attention.py " + " ".join(sys.argv[1:])}
    lines = ["# Slot attention (GLM-4.5-Air heads, bf16)", "", *(f"- {k}: {v}" for k, v in meta.items()), "",
             "µs per call; every sequence at its last cache position", "",
             "| context | B | splits | kernel | of HBM | kernel, 1 split | reference (per sequence) | rel. error |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['batch']} | {r['splits']} | {r['kernel_us']:.1f} | "
              f"{r['hbm_floor_us'] / r['kernel_us']:.0%} | {r['one_split_us']:.1f} | {r['reference_us']:.1f} | "
              f"{r['rel_error']:.1e} |" for r in rows]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "slot_attention.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (args.out / "slot_attention.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
