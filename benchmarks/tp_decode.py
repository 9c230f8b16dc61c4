"""Decode step of the L16 model with tensor parallelism over 2 GPUs (NCCL all-reduces between pieces), against
the same model whole on one GPU; both as piecewise (eager pieces).

    PYTHONPATH=src python benchmarks/tp_decode.py --out DIR [--nvfp4] [--capture-all-reduce]

Writes tp_decode.json and tp_decode.md (rank 0). Host-inclusive ms per step, median of rounds as in
decode_step.py; rel. error of the 2-GPU output against the 1-GPU one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import inputs, round_robin_ms  # noqa: E402

import piecewise  # noqa: E402
from piecewise.models.decode import L16, DecodeLlama  # noqa: E402
from piecewise.models.llama import tensor_parallel_llama  # noqa: E402

BATCHES = (1, 8, 32)


def build(nvfp4: bool) -> DecodeLlama:
    torch.manual_seed(0)
    model = DecodeLlama(L16).to(device="cuda", dtype=torch.bfloat16).eval()
    if nvfp4:
        from piecewise.kernels.nvfp4 import quantize_linears

        quantize_linears(model)
    return model


def steps_for(model, cache):
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=max(BATCHES)))
    ids, positions, _ = inputs(max(BATCHES), cache, L16.vocab_size)
    runner.capture(ids, positions, cache)
    steps, outs = {}, {}
    for batch in BATCHES:
        ids, positions, _ = inputs(batch, cache, L16.vocab_size)
        outs[batch] = runner(ids, positions, cache).clone()
        steps[batch] = lambda r=runner, ids=ids, positions=positions: r(ids, positions, cache)
    return runner, steps, outs


def worker(rank: int, init_file: str, out_dir: str | None, nvfp4: bool, capture_all_reduce: bool) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    try:
        single, reference = {}, {}
        if rank == 0:  # the whole model on one GPU first
            model = build(nvfp4)
            cache = model.make_kv_cache(max(BATCHES))
            cache.normal_(generator=torch.Generator("cuda").manual_seed(1))
            with torch.no_grad():
                runner, steps, reference = steps_for(model, cache)
                single = round_robin_ms(steps)
            del model, cache, steps, runner
        dist.barrier()
        model = build(nvfp4)
        tensor_parallel_llama(model, capture_all_reduce=capture_all_reduce)
        cache = model.make_kv_cache(max(BATCHES))
        full = torch.empty(L16.num_layers, 2, max(BATCHES), L16.num_kv_heads, L16.max_seq_len, L16.head_dim,
                           device="cuda", dtype=torch.bfloat16).normal_(generator=torch.Generator("cuda").manual_seed(1))
        share = L16.num_kv_heads // 2
        cache.copy_(full[:, :, :, rank * share : (rank + 1) * share])  # this rank's heads of the same cache
        del full
        with torch.no_grad():
            runner, steps, outs = steps_for(model, cache)
            tp = round_robin_ms(steps)
        runner.release_graphs()  # before destroy_process_group: NCCL waits for graphs holding its collectives
        if rank == 0 and out_dir:
            errors = {b: float((outs[b].float() - reference[b].float()).norm() / reference[b].float().norm())
                      for b in BATCHES}
            write(Path(out_dir), single, tp, errors, nvfp4, capture_all_reduce)
    finally:
        dist.destroy_process_group()


def write(out: Path, single: dict, tp: dict, errors: dict, nvfp4: bool, capture_all_reduce: bool) -> None:
    meta = {
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(), "command": "PYTHONPATH=src python benchmarks/tp_decode.py " + " ".join(sys.argv[1:]),
        "model": "L16 decode step (see decode_step.py), KV context 1024",
        "weights": "NVFP4 (every Linear but lm_head), W4A16" if nvfp4 else "bf16",
        "all-reduce": "captured in the pieces' graphs" if capture_all_reduce else "a splitting op (eager between pieces)",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_decode.json").write_text(json.dumps({"meta": meta, "one_gpu_ms": single, "two_gpus_ms": tp,
                                                    "rel_error": errors}, indent=2))
    lines = ["# Decode step with tensor parallelism, L16 model", "", *(f"- {k}: {v}" for k, v in meta.items()), "",
             "ms per step, piecewise (eager pieces), host-inclusive; rel. error of the 2-GPU logits vs 1 GPU", "",
             "| | " + " | ".join(f"B={b}" for b in BATCHES) + " |", "|---|" + "---|" * len(BATCHES),
             "| 1 GPU | " + " | ".join(f"{single[b]:.3f}" for b in BATCHES) + " |",
             "| 2 GPUs (TP=2) | " + " | ".join(f"{tp[b]:.3f} ({errors[b]:.1e})" for b in BATCHES) + " |", ""]
    (out / "tp_decode.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--nvfp4", action="store_true")
    parser.add_argument("--capture-all-reduce", action="store_true",
                        help="cut only at attention: the NCCL all-reduce is captured inside the graphs")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print("tp_decode.py needs two CUDA GPUs", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(worker, args=(os.path.join(directory, "init"), args.out, args.nvfp4, args.capture_all_reduce), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
