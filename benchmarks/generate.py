"""``piecewise.generate`` end to end against transformers' fast path, on the same prompts.

    PYTHONPATH=src python benchmarks/generate.py --out DIR [--config benchmarks/configs/llama-3.2-1b]
        [--batches 32,8,1] [--prompt 512] [--new 128]
    PYTHONPATH=src python benchmarks/generate.py --tiny          # a two-layer model on any device, no compile

A transformers causal LM from a config folder with random weights (bf16 on CUDA). For each batch B: B prompts of
``--prompt`` random tokens, ``--new`` new tokens each, greedy, no stop token (``min_new_tokens``). Two ways:
- transformers: ``model.generate(ids, cache_implementation="static")``, which compiles the decode step
  (``torch.compile``, CUDA graphs) and prefills all prompts in one eager batched call, what its docs recommend;
- piecewise: ``piecewise.generate(model, prompts)`` with its defaults (prefill calls of 2048 tokens through the
  KV cache's slots, decode steps of every running sequence).
Each is run once to warm up (compile, capture: the first call's seconds), then timed: wall time, tokens/s (new
tokens of all prompts over wall time), time to the first new token (transformers: a call with one new token;
piecewise: the stream's first token and its last prompt's first token), and ms per decode step after it. The
tokens of the two are compared (bf16 near-ties may part them; the fraction of equal leading tokens is given).
Writes generate.md and generate.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

import piecewise

ROOT = Path(__file__).resolve().parent


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(config_folder: Path, tiny: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_folder)
    if tiny:
        config.num_hidden_layers, config.hidden_size, config.intermediate_size = 2, 128, 256
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 32
        config.vocab_size = 512
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def transformers_run(model, ids: torch.Tensor, new: int, compile_decode: bool) -> tuple[torch.Tensor, float]:
    sync()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, cache_implementation="static", disable_compile=not compile_decode,
                         pad_token_id=0)
    sync()
    return out[:, ids.shape[1]:].cpu(), time.perf_counter() - start


def piecewise_run(model, prompts: list[torch.Tensor], new: int) -> tuple[list[torch.Tensor], dict]:
    tokens: list[list[int]] = [[] for _ in prompts]
    times = {}
    sync()
    start = time.perf_counter()
    for index, token in piecewise.generate_stream(model, prompts, new, stop_tokens=()):
        if not times:
            times["first_token_s"] = time.perf_counter() - start
        tokens[index].append(token)
        if "all_first_s" not in times and all(tokens):
            times["all_first_s"] = time.perf_counter() - start
    sync()
    times["wall_s"] = time.perf_counter() - start
    return [torch.tensor(t) for t in tokens], times


def leading_match(a: torch.Tensor, b: torch.Tensor) -> int:
    unequal = (a != b).nonzero()
    return len(a) if len(unequal) == 0 else int(unequal[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "llama-3.2-1b")
    parser.add_argument("--batches", default="32,8,1")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.prompt, args.new, args.batches = 24, 6, "3,1"
    model = build(args.config, args.tiny)
    device = next(model.parameters()).device
    compile_decode = device.type == "cuda"
    batches = [int(x) for x in args.batches.split(",")]
    prompts_of, theirs_of, rows = {}, {}, {}
    for b in batches:  # transformers first: piecewise's attention, once enabled, refuses transformers' own cache
        generator = torch.Generator().manual_seed(b)
        ids = torch.randint(0, model.config.vocab_size, (b, args.prompt), generator=generator).to(device)
        prompts_of[b] = list(ids)
        row = rows[b] = {"batch": b}
        with torch.inference_mode():
            _, row["transformers_first_run_s"] = transformers_run(model, ids, args.new, compile_decode)
            theirs_of[b], row["transformers_wall_s"] = transformers_run(model, ids, args.new, compile_decode)
            _, row["transformers_ttft_s"] = transformers_run(model, ids, 1, compile_decode)
    for b in batches:
        row = rows[b]
        _, first = piecewise_run(model, prompts_of[b], args.new)
        row["piecewise_first_run_s"] = first["wall_s"]
        ours, times = piecewise_run(model, prompts_of[b], args.new)
        theirs = theirs_of[b]
        row.update({"piecewise_" + k: v for k, v in times.items()})
        for who in ("transformers", "piecewise"):
            row[who + "_tokens_per_s"] = b * args.new / row[who + "_wall_s"]
        row["transformers_decode_ms"] = (row["transformers_wall_s"] - row["transformers_ttft_s"]) * 1e3 / (args.new - 1)
        row["piecewise_decode_ms"] = (row["piecewise_wall_s"] - row["piecewise_all_first_s"]) * 1e3 / (args.new - 1)
        matched = [leading_match(ours[i], theirs[i]) for i in range(b)]
        row["equal_leading_tokens"] = sum(matched) / (b * args.new)
        row["first_token_equal"] = sum(int(ours[i][0] == theirs[i][0]) for i in range(b)) / b
        print(json.dumps(row), flush=True)
    rows = [rows[b] for b in batches]
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "model": f"{args.config.name}{' (tiny)' if args.tiny else ''}, random weights, "
                       f"{next(model.parameters()).dtype}",
              "prompt": args.prompt, "new": args.new,
              "command": "PYTHONPATH=src python benchmarks/generate.py " + " ".join(sys.argv[1:]), "rows": rows}
    lines = [f"# piecewise.generate against transformers' static-cache compiled generate ({result['date']})", "",
             (f"`{result['command']}` · torch {result['torch']} · {result['device']} · {result['model']} · "
             f"{args.prompt}-token prompts, {args.new} new tokens each, greedy"), "",
             "| B | who | first run s | wall s | tokens/s | first token ms | all first tokens ms | decode ms/step |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['batch']} | transformers | {row['transformers_first_run_s']:.1f} | "
                     f"{row['transformers_wall_s']:.3f} | {row['transformers_tokens_per_s']:.0f} | "
                     f"{row['transformers_ttft_s'] * 1e3:.1f} | {row['transformers_ttft_s'] * 1e3:.1f} | "
                     f"{row['transformers_decode_ms']:.2f} |")
        lines.append(f"| {row['batch']} | piecewise | {row['piecewise_first_run_s']:.1f} | "
                     f"{row['piecewise_wall_s']:.3f} | {row['piecewise_tokens_per_s']:.0f} | "
                     f"{row['piecewise_first_token_s'] * 1e3:.1f} | {row['piecewise_all_first_s'] * 1e3:.1f} | "
                     f"{row['piecewise_decode_ms']:.2f} |")
    lines += ["", "Equal tokens (leading, fraction of all new tokens) / equal first token: " + ", ".join(
        f"B={r['batch']}: {r['equal_leading_tokens']:.2f} / {r['first_token_equal']:.2f}" for r in rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "generate.md").write_text(text)
        (args.out / "generate.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
