"""Decode step of a transformers GLM-MoE model (GLM-4.5-Air layer shapes, NVFP4 weights, grouped experts in the
graphs) on one GPU and with tensor parallelism over two (``integrations.transformers.tensor_parallel``,
all-reduces captured in the graphs).

    PYTHONPATH=src python benchmarks/hf_tp_decode.py --out DIR [--layers 4] [--context 512] [--batch 1,8,32]
    PYTHONPATH=src python benchmarks/hf_tp_decode.py --tiny      # small config; two CPU processes (gloo) without GPUs

Writes hf_tp_decode.json and hf_tp_decode.md (rank 0): host-inclusive ms per decode step of B sequences (one
token each, one flattened call with ``slots``), median of rounds as in hf_decode.py, and the rel. error of the
two-GPU logits against the one-GPU ones (same weights, same tokens).
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
from hf_decode import AIR, TINY, build, parse_arguments, rel_error, timed  # noqa: E402

import piecewise  # noqa: E402
from piecewise.integrations.transformers import TokenModel, enable, quantize, tensor_parallel  # noqa: E402


def decode(model, ids, prompt_len: int, batches: list[int], device: str, rounds: int, iters: int):
    """Prefill every sequence into its slot, then time one-token steps of B sequences: (ms, logits) by B."""
    widest = max(batches)
    token_model = TokenModel(model)
    cache = token_model.make_kv_cache(max_seq_len=prompt_len + 1, sequences=widest)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=widest))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    positions = torch.full((widest,), prompt_len, device=device)
    ms, logits = {}, {}
    with torch.no_grad():
        for slot in range(widest):
            runner(ids[slot, :prompt_len], torch.arange(prompt_len, device=device), cache,
                   torch.full((prompt_len,), slot, device=device))
        for b in batches:
            slots = torch.arange(b, device=device)

            def step(b=b, slots=slots):
                return runner(ids[:b, prompt_len], positions[:b], cache, slots)

            logits[b] = step().float()
            ms[b] = timed(step, sync, rounds, iters)
    return runner, ms, logits


def worker(rank: int, init_file: str, args: argparse.Namespace) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=2, **({"device_id": torch.device("cuda", rank)} if device == "cuda" else {}))
    try:
        values = TINY if args.tiny else AIR
        dtype = torch.bfloat16
        rounds, iters = (3, 3) if args.tiny else (7, 20)
        prompt_len = min(args.context, 32) if args.tiny else args.context
        batches = [int(b) for b in args.batch.split(",")]
        generator = torch.Generator(device).manual_seed(1)
        ids = torch.randint(0, values["vocab_size"], (max(batches), prompt_len + 1), device=device, generator=generator)

        def prepared():
            model = build(values, args.layers, device, dtype)
            enable(model)
            quantize(model)  # every linear layer but the head, and the experts (grouped, in the graphs)
            return model

        single, reference = {}, {}
        if rank == 0:  # the whole model on one GPU first
            runner, single, reference = decode(prepared(), ids, prompt_len, batches, device, rounds, iters)
            runner.release_graphs()
            del runner
            if device == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()
        model = prepared()
        tensor_parallel(model, capture_all_reduce=True)
        runner, tp, logits = decode(model, ids, prompt_len, batches, device, rounds, iters)
        runner.release_graphs()  # before destroy_process_group: NCCL waits for graphs holding its collectives
        if rank == 0:
            errors = {b: rel_error(logits[b], reference[b]) for b in batches}
            write(args, single, tp, errors, prompt_len, batches, device)
    finally:
        dist.destroy_process_group()


def write(args, single: dict, tp: dict, errors: dict, prompt_len: int, batches: list[int], device: str) -> None:
    meta = {
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (gloo)",
        "command": "PYTHONPATH=src python benchmarks/hf_tp_decode.py " + " ".join(sys.argv[1:]),
        "model": f"Glm4MoeForCausalLM, {args.layers} layers ({'tiny config' if args.tiny else 'GLM-4.5-Air layer shapes'}), "
                 f"random weights, NVFP4 (every linear layer but the head; routed experts grouped, in the graphs), "
                 f"bf16 activations, {prompt_len} tokens of context per sequence",
        "tensor parallel": "attention heads, dense MLP and every expert's intermediate dimension split over 2 "
                           "ranks; the all-reduces captured in the graphs",
    }
    lines = ["# Decode step of a transformers GLM-MoE model, tensor parallel", "",
             *(f"- {k}: {v}" for k, v in meta.items()), "",
             "ms per step (B sequences, one token each); in brackets, the rel. error of the two-GPU logits against "
             "the one-GPU ones", "",
             "| | " + " | ".join(f"B={b}" for b in batches) + " |", "|---|" + "---|" * len(batches),
             "| 1 GPU | " + " | ".join(f"{single[b]:.3f}" for b in batches) + " |",
             "| 2 GPUs (TP=2) | " + " | ".join(f"{tp[b]:.3f} ({errors[b]:.1e})" for b in batches) + " |", ""]
    print("\n".join(lines))
    if args.out:
        out = args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "hf_tp_decode.json").write_text(json.dumps(
            {"meta": meta, "one_gpu_ms": single, "two_gpus_ms": tp, "rel_error": errors}, indent=2))
        (out / "hf_tp_decode.md").write_text("\n".join(lines))


def main() -> int:
    args = parse_arguments(__doc__.splitlines()[0])
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        print("hf_tp_decode.py needs two CUDA GPUs (or none: --tiny runs on two CPU processes)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(worker, args=(os.path.join(directory, "init"), args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
