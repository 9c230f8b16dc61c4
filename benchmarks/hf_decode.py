"""Decode step of a transformers GLM-MoE model (GLM-4.5-Air layer shapes, few layers, random weights): transformers
eager with its DynamicCache, against piecewise (``integrations.transformers``: attention as a splitting op; the
experts either captured in the graphs, transformers' grouped_mm, or a splitting op), with bf16 and NVFP4 weights.

    PYTHONPATH=src python benchmarks/hf_decode.py --out DIR [--layers 4] [--context 512] [--batch 1,8,32]
    PYTHONPATH=src python benchmarks/hf_decode.py --tiny          # a small config on any device (checks the script)
    PYTHONPATH=src python benchmarks/hf_decode.py --model glm5 --context 2048 [--frontend breakable]   # GLM-5 (DSA)

Writes hf_decode.json and hf_decode.md: host-inclusive ms per decode step of B sequences (one token each; piecewise
takes them as one flattened call with ``slots``), median of rounds, and each variant's rel. error against
transformers' logits for the same tokens.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import piecewise
from piecewise.integrations.transformers import TokenModel, enable, quantize

AIR = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
           num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128, num_experts_per_tok=8,
           n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, partial_rotary_factor=0.5,
           attention_bias=True, routed_scaling_factor=1.0, norm_topk_prob=True)
TINY = dict(AIR, vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=16, num_experts_per_tok=4)


GLM5 = dict(vocab_size=154880)  # transformers' GlmMoeDsaConfig defaults are GLM-5's shapes
GLM5_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                 v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1,
                 first_k_dense_replace=1, n_shared_experts=1, index_n_heads=16, index_head_dim=32, index_topk=16)
MODELS = {"glm45air": ("Glm4Moe", AIR, TINY, "GLM-4.5-Air layer shapes"),
          "glm5": ("GlmMoeDsa", GLM5, GLM5_TINY, "GLM-5 layer shapes, DeepSeek sparse attention")}


PREFILL_CHUNK = 256  # prompt tokens per transformers call when filling its cache


def build(config_values: dict, layers: int, device: str, dtype: torch.dtype, architecture: str = "Glm4Moe"):
    import transformers

    config = getattr(transformers, f"{architecture}Config")(num_hidden_layers=layers, **config_values)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, f"{architecture}ForCausalLM")(config).to(dtype).eval()
    for module in model.modules():  # transformers leaves expert weights uninitialised outside from_pretrained
        if hasattr(module, "gate_up_proj"):
            torch.nn.init.normal_(module.gate_up_proj, std=0.02)
            torch.nn.init.normal_(module.down_proj, std=0.02)
    return model


START = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", file=sys.stderr, flush=True)


def timed(step, sync, rounds: int, iters: int) -> float:
    for _ in range(3):
        step()
    samples = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            step()
        sync()
        samples.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(samples)


def rel_error(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def with_weights_of(quantized, reference):
    """``reference`` (an unquantized copy) given the dequantized weights of ``quantized`` (after ``quantize``),
    in place: transformers' own forward on the numbers the NVFP4 variants compute with."""
    from piecewise.kernels.nvfp4 import NVFP4Linear, dequantize

    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, NVFP4Linear):
                reference.get_submodule(name).weight.copy_(module.dequantized_weight(reference.dtype))
            nvfp4 = getattr(module, "nvfp4", None)
            if nvfp4 is not None:
                target = reference.get_submodule(name)
                for stacked, attr in ((target.gate_up_proj, "gate_up"), (target.down_proj, "down")):
                    packed, scales, decode = (getattr(nvfp4, attr + suffix) for suffix in ("", "_scale", "_scale_2"))
                    for e in range(stacked.shape[0]):
                        stacked[e] = dequantize(packed[e], scales[e], 1 / decode[e], dtype=stacked.dtype)
    return reference


VARIANTS = (
    # (name, experts between pieces, NVFP4: None / "split" / "grouped"); run in this order on one model
    ("piecewise, transformers' grouped_mm experts in the graphs", False, None),
    ("piecewise, experts between pieces", True, None),
    ("piecewise, NVFP4 weights, experts between pieces", True, "split"),
    ("piecewise, NVFP4 weights, grouped experts in the graphs", True, "grouped"),
)


def report(args, architecture, shapes, dtype, prompt_len, batches, results, errors, capture, frontends,
           reference_error, final=False) -> None:
    """hf_decode.md / .json of the rows measured so far (after each variant: a run cut short keeps them)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    meta = {
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "command": "PYTHONPATH=src python benchmarks/hf_decode.py " + " ".join(sys.argv[1:]),
        "model": f"{architecture}ForCausalLM, {args.layers} layers ({'tiny config' if args.tiny else shapes}), "
                 f"random weights, {dtype}, {prompt_len} tokens of context per sequence",
    }
    lines = ["# Decode step of a transformers GLM-MoE model", "", *(f"- {k}: {v}" for k, v in meta.items()), "",
             "ms per step (B sequences, one token each); in brackets, the rel. error of the logits against "
             "transformers' forward without a cache on the same weights (NVFP4 rows: the dequantized NVFP4 weights)", "",
             "| variant | " + " | ".join(f"B={b}" for b in batches) + " |", "|---|" + "---|" * len(batches)]
    lines += [f"| {name} | " + " | ".join(f"{row[b]:.3f} ({errors[name][b]:.1e})" for b in batches) + " |"
              for name, row in results.items()]
    lines += ["", *(f"- capture seconds, {name}: {seconds:.1f} ({frontends[name]})"
                    for name, seconds in capture.items())]
    if reference_error:
        lines += ["- NVFP4 weights against the bf16 model (transformers' forward, both): rel. error "
                  + ", ".join(f"{reference_error[b]:.1e} at B={b}" for b in batches)]
    lines += [""]
    if final:
        print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"meta": meta, "ms": results, "rel_error": errors, "capture_seconds": capture,
                   "nvfp4_vs_bf16_rel_error": reference_error}
        (args.out / "hf_decode.json").write_text(json.dumps(payload, indent=2))
        (args.out / "hf_decode.md").write_text("\n".join(lines))


def parse_arguments(description: str) -> argparse.Namespace:
    """The options hf_decode.py and hf_tp_decode.py share."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of each sequence before the step")
    parser.add_argument("--batch", default="1,8,32", help="sequences decoding together, comma-separated")
    parser.add_argument("--tiny", action="store_true", help="a small config (checks the script on any machine)")
    parser.add_argument("--model", default="glm45air", choices=sorted(MODELS), help="layer shapes (default glm45air)")
    parser.add_argument("--shared-prompt", action="store_true",
                        help="all sequences share one prompt (piecewise prefills it once and copies the cache rows)")
    parser.add_argument("--frontend", default="auto", choices=["auto", "dynamo", "breakable"], help="piecewise front-end")
    return parser.parse_args()


def main() -> int:
    args = parse_arguments(__doc__.splitlines()[0])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rounds, iters = (3, 3) if args.tiny else (7, 20)
    architecture, real, tiny, shapes = MODELS[args.model]
    config_values = tiny if args.tiny else real
    prompt_len = min(args.context, 32) if args.tiny else args.context
    batches = [int(b) for b in args.batch.split(",")]
    widest = max(batches)
    ids = torch.randint(0, config_values["vocab_size"], (widest, prompt_len + 1), device=device)
    if args.shared_prompt:  # one prompt, each sequence its own next token
        ids[:, :prompt_len] = ids[0, :prompt_len]
    positions = torch.full((widest,), prompt_len, device=device)

    results: dict[str, dict[int, float]] = {}
    errors: dict[str, dict[int, float]] = {}
    capture: dict[str, float] = {}
    frontends: dict[str, str] = {}
    with torch.no_grad():
        model = build(config_values, args.layers, device, dtype, architecture)
        progress("model built")
        as_built = (model.config._attn_implementation, model.config._experts_implementation)

        def last_logits(m):  # one sequence at a time: a batch of long prompts would not fit (GLM-5's indexer)
            rows = torch.cat([m(input_ids=ids[s : s + 1], use_cache=False, logits_to_keep=1).logits[:, -1]
                              for s in range(widest)])
            return {b: rows[:b] for b in batches}

        expected = last_logits(model)
        progress("transformers' logits without a cache")
        reference_error: dict[int, float] = {}  # the NVFP4 model against the bf16 one
        from transformers import DynamicCache

        for b in batches:  # transformers eager, its own cache, b sequences of equal length
            cache = DynamicCache(config=model.config)
            for start in range(0, prompt_len, PREFILL_CHUNK):  # the prompts in chunks: bounded memory
                model(input_ids=ids[:b, start : min(start + PREFILL_CHUNK, prompt_len)], past_key_values=cache,
                      use_cache=True)

            def hf_step(b=b, cache=cache):
                out = model(input_ids=ids[:b, prompt_len:], past_key_values=cache, use_cache=True).logits
                cache.crop(-1)  # drop the step's token again
                return out

            errors.setdefault("transformers eager", {})[b] = rel_error(hf_step()[:, -1], expected[b])
            results.setdefault("transformers eager", {})[b] = timed(hf_step, sync, rounds, iters)
            progress(f"transformers eager, B={b}")
            del cache

        for name, split_experts, nvfp4 in VARIANTS:
            if nvfp4 == "grouped":  # the experts are NVFP4 already (the variant before): regroup them
                for module in model.modules():
                    if getattr(module, "nvfp4", None) is not None:
                        module.nvfp4.grouped = True
            if not split_experts:
                model.config._experts_implementation = "grouped_mm"
            token_model = TokenModel(enable(model, experts=split_experts))
            if nvfp4 == "split":
                reference = copy.deepcopy(model)
                reference.config._attn_implementation, reference.config._experts_implementation = as_built
                quantize(model, grouped_experts=False)
                expected_nvfp4 = last_logits(with_weights_of(model, reference))
                reference_error = {b: rel_error(expected_nvfp4[b], expected[b]) for b in batches}
                del reference
            kv_cache = token_model.make_kv_cache(max_seq_len=prompt_len + 1, sequences=widest)
            # decode sizes only: prompts above max_tokens run the compiled pieces without graphs
            runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=max(batches), frontend=args.frontend))
            for slot in range(1 if args.shared_prompt else widest):  # prefill each sequence into its slot
                runner(ids[slot, :prompt_len], torch.arange(prompt_len, device=device), kv_cache,
                       torch.full((prompt_len,), slot, device=device))
            if args.shared_prompt:  # the other slots: slot 0's cache rows (the indexer key caches too)
                kv_cache[:, :, 1:] = kv_cache[:, :, :1]
                for buffer_name, index_cache in token_model.named_buffers():
                    if buffer_name.endswith("piecewise_index_cache"):
                        index_cache[1:] = index_cache[:1]
            progress(f"{name}: prefilled, {runner.stats['capture_seconds']:.1f} s of capture")
            for b in batches:
                slots = torch.arange(b, device=device)

                def step(b=b, slots=slots, runner=runner, kv_cache=kv_cache):
                    return runner(ids[:b, prompt_len], positions[:b], kv_cache, slots)

                errors.setdefault(name, {})[b] = rel_error(step(), expected_nvfp4[b] if nvfp4 else expected[b])
                results.setdefault(name, {})[b] = timed(step, sync, rounds, iters)
            capture[name] = runner.stats["capture_seconds"]
            frontends[name] = f"{runner.stats['frontend']} front-end, graph_mode {runner.stats['graph_mode']}"
            progress(f"{name}: {results[name]}")
            report(args, architecture, shapes, dtype, prompt_len, batches, results, errors, capture, frontends,
                   reference_error)
            del runner, token_model, kv_cache, step  # this variant's graphs and cache, before the next one's
            if device == "cuda":
                torch.cuda.empty_cache()

    report(args, architecture, shapes, dtype, prompt_len, batches, results, errors, capture, frontends,
           reference_error, final=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
