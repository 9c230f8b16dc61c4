"""Serve an NVFP4 checkpoint in ModelOpt's format (NVIDIA's `*-FP4` / `*-NVFP4` models) under piecewise.

    python examples/nvfp4_checkpoint.py FOLDER --device cuda        # a checkpoint on disk
    python examples/nvfp4_checkpoint.py                              # writes a tiny one first (no download)

The model is built on the meta device from the folder's config.json (its 16-bit weights are never allocated),
``load_modelopt_nvfp4`` puts the NVFP4 layers and experts and every other tensor on the device, and
``examples/continuous_batching.py``'s scheduler generates for a few random prompts. Without FOLDER, a tiny
random GLM-MoE is quantized (``quantize``), written with ``save_modelopt_nvfp4`` into a temporary folder and
loaded back, and its logits are checked against the model that wrote it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers

import piecewise
from piecewise.integrations.modelopt import load_modelopt_nvfp4, save_modelopt_nvfp4
from piecewise.integrations.transformers import TokenModel, enable, quantize
from piecewise.kernels.nvfp4 import NVFP4Linear

from continuous_batching import generate  # the example beside this one
from glm_moe_transformers import model as tiny_glm_moe


def load(folder: Path, device: str, dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    load_modelopt_nvfp4(model, folder, device=device)
    return model


def write_tiny(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """A tiny random GLM-MoE, quantized and saved in ModelOpt's format; returns the quantized model."""
    model = tiny_glm_moe(None, "cpu", dtype)
    quantize(enable(model))
    save_modelopt_nvfp4(model, folder)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, help="a ModelOpt NVFP4 checkpoint (default: write a tiny one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=6)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as scratch:
        folder, written = args.folder, None
        if folder is None:
            folder = Path(scratch)
            written = write_tiny(folder, dtype)
        started = time.perf_counter()
        model = load(folder, args.device, dtype)
        print(f"loaded {folder} in {time.perf_counter() - started:.1f} s: "
              f"{sum(isinstance(m, NVFP4Linear) for m in model.modules())} NVFP4 linear layers")
    vocab = model.config.vocab_size
    if written is not None:  # the reloaded model computes what the model that wrote it computes
        ids = torch.randint(0, vocab, (1, 9))
        with torch.no_grad():
            same = torch.equal(enable(model)(input_ids=ids.to(args.device)).logits.cpu(), written(input_ids=ids).logits)
        print(f"reloaded logits equal the quantized model's: {same}")
        if not same:
            return 1
    token_model = TokenModel(enable(model))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (int(torch.randint(3, 12, (), generator=generator)),), generator=generator)
               .to(args.device) for _ in range(args.requests)]
    with torch.no_grad():
        outputs = generate(runner, token_model, prompts, args.new_tokens, slots=4, max_seq_len=64)
    for request, tokens in enumerate(outputs[:3]):
        print(f"request {request}: prompt {len(prompts[request])} tokens → {tokens}")
    print(f"CUDA graphs: {'yes' if runner.stats['cuda_graphs'] else 'no'}, replays {runner.stats['replays']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
