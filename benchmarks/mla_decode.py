"""MLA models at serving scale: decode steps and prefill of a transformers GLM-5 (DeepSeek sparse attention) or
DeepSeek-V3 (dense MLA) with its first layers, random weights, NVFP4 linear layers and grouped experts, over the
latent cache (``integrations.mla``), against the per-head cache (``enable(latent_cache=False)``).

    PYTHONPATH=src python benchmarks/mla_decode.py --model glm5 --out DIR [--layers 4] [--context 2048,8192]
        [--batch 1,8,32,128] [--prefill 2048,8192] [--per-head]
    PYTHONPATH=src python benchmarks/mla_decode.py --tiny          # a small config on any device (checks the script)

Per context length: one prompt prefilled into slot 0 and its cache rows copied into every slot (each sequence
then decodes its own next token), ms per decode step of B sequences (host-inclusive, median of rounds), the step's
floor (weights it must read plus the latent rows and indexer keys its attention reads, over the HBM bandwidth),
and the step's logits against transformers' forward without a cache on the same (dequantized) weights for the first
two sequences. Cache bytes per token and layer, and the most sequences of each context that fit beside the weights
in 120 GiB, with either cache. Prefill: one sequence of each length, ms. Writes mla_decode.json / .md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import piecewise  # noqa: E402
from hf_decode import GLM5, GLM5_TINY, build, progress, rel_error, timed, with_weights_of  # noqa: E402
from piecewise.integrations import mla  # noqa: E402
from piecewise.integrations.transformers import TokenModel, enable, quantize  # noqa: E402

DSV3 = dict()  # transformers' DeepseekV3Config defaults are DeepSeek-V3's shapes
DSV3_TINY = {k: v for k, v in GLM5_TINY.items() if not k.startswith("index")}
MODELS = {"glm5": ("GlmMoeDsa", GLM5, GLM5_TINY), "dsv3": ("DeepseekV3", DSV3, DSV3_TINY)}
HBM = 4.8e12  # the H200's bytes per second
BUDGET = 120 * 2**30  # what cache and weights may take


def step_floor_bytes(model, batch: int, context: int, row_bytes: int | None = None) -> int:
    """What one decode step of ``batch`` sequences must read at least: every weight but the embedding table and
    the routed experts no token chose (at most B·k of them), plus the latent rows its attention reads (each
    query's picks, or its whole context; ``row_bytes`` each, bf16 rows by default) and, for DSA, the indexer keys
    of the whole context."""
    c = model.config
    experts = total = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if "embed_tokens" in name or "piecewise_index_cache" in name:
            continue
        size = tensor.numel() * tensor.element_size()
        if ".experts." in name or name.endswith(".experts") or ".nvfp4." in name:
            experts += size
        else:
            total += size
    routed = getattr(c, "n_routed_experts", 0) or 1
    total += experts * min(1.0, batch * getattr(c, "num_experts_per_tok", 1) / routed)
    rows = min(context, getattr(c, "index_topk", context) or context)
    row_bytes = row_bytes or (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    total += batch * rows * row_bytes * c.num_hidden_layers
    indexers = sum(1 for m in model.modules() if type(m).__name__.endswith("Indexer"))
    total += batch * context * getattr(c, "index_head_dim", 0) * 2 * indexers
    return int(total)


def _compiler(row: dict) -> str:
    """The pieces' compiler of a decode row: as given, or what ``"auto"`` took (from its reason)."""
    taken = re.search(r"compiler '(\w+)'", row.get("reason") or "")
    return row.get("compiler", "eager") if row.get("compiler") != "auto" or not taken else f"auto: {taken.group(1)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", default="glm5", choices=sorted(MODELS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", default="2048,8192")
    parser.add_argument("--batch", default="1,8,32,128")
    parser.add_argument("--prefill", default="2048,8192")
    parser.add_argument("--per-head", action="store_true", help="also the per-head cache (B and context that fit)")
    parser.add_argument("--frontend", default="auto", choices=["auto", "dynamo", "breakable"])
    parser.add_argument("--compiler", default="auto", choices=["auto", "eager", "inductor"],
                        help="the pieces' compiler (default: the library's, measured at the first call)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--cache-dtype", default="model", choices=["model", "fp8"],
                        help="the latent cache's rows: the model's dtype, or FP8 (kernels.latent_fp8)")
    parser.add_argument("--profile", type=int, default=0, help="profile the decode step of this many sequences")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rounds, iters = (2, 2) if args.tiny else (5, 10)
    architecture, real, tiny = MODELS[args.model]
    contexts = [int(c) for c in args.context.split(",") if c]
    batches = [int(b) for b in args.batch.split(",")]
    prefills = [int(p) for p in args.prefill.split(",") if p]
    if args.tiny:
        contexts, prefills = [min(c, 48) for c in contexts], [min(p, 48) for p in prefills]
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "command": "PYTHONPATH=src python benchmarks/mla_decode.py " + " ".join(sys.argv[1:]),
            "model": f"{architecture}ForCausalLM, {args.layers} layers ({'tiny' if args.tiny else 'real'} shapes), "
                     f"random weights, NVFP4 linear layers (kv_b_proj, lm_head bf16) and grouped NVFP4 experts"}
    result: dict = {"meta": meta, "decode": [], "prefill": [], "cache": {}}

    def write() -> None:
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"mla_decode-{args.model}.json").write_text(json.dumps(result, indent=2))
            (args.out / f"mla_decode-{args.model}.md").write_text(markdown(result))

    with torch.no_grad():
        model = build(tiny if args.tiny else real, args.layers, device, dtype, architecture)
        as_built = model.config._attn_implementation, model.config._experts_implementation
        reference = copy.deepcopy(model) if args.tiny or device == "cuda" else None
        token_model = TokenModel(enable(model, experts=True))
        quantize(model)
        if reference is not None:
            with_weights_of(model, reference)
            reference.config._attn_implementation, reference.config._experts_implementation = as_built
        progress("model built and quantized")
        weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        c = model.config
        cache_dtype = "fp8" if args.cache_dtype == "fp8" else None
        for kind, latent, kind_dtype in (("latent", True, None), ("latent fp8", True, "fp8"),
                                         ("per-head", False, None)):
            enable(model, experts=True, latent_cache=latent)
            per_token = token_model.kv_bytes_per_token(kind_dtype)
            result["cache"][kind] = {
                "bytes_per_token_per_layer": per_token / c.num_hidden_layers,
                "largest_batch": {ctx: int((BUDGET - weights) // (per_token * ctx)) for ctx in contexts}}
        result["cache"]["weights_bytes"] = weights
        modes = [True, False] if args.per_head else [True]
        for latent in modes:
            enable(model, experts=True, latent_cache=latent)
            label = ("latent cache" + (" (fp8)" if cache_dtype else "")) if latent else "per-head cache"
            dtype_of_cache = cache_dtype if latent else None
            row_bytes = mla.row_bytes(c, cache_dtype or dtype) if latent else None
            for ctx in contexts if latent else contexts[:1]:  # the per-head cache: the shortest context, B <= 32
                fits = [b for b in batches if token_model.kv_bytes_per_token(dtype_of_cache) * (ctx + 1) * b
                        < BUDGET - weights
                        and (latent or b <= 32)]
                if not fits:
                    continue
                widest = max(fits)
                ids = torch.randint(0, c.vocab_size, (widest, ctx + 1), device=device)
                ids[:, :ctx] = ids[0, :ctx].clone()
                cache = token_model.make_kv_cache(max_seq_len=ctx + 1, sequences=widest, dtype=dtype_of_cache)
                runner = piecewise.compile(token_model, piecewise.CaptureConfig(
                    max_tokens=widest, frontend=args.frontend, compiler=args.compiler))
                runner(ids[0, :ctx], torch.arange(ctx, device=device), cache,
                       torch.zeros(ctx, dtype=torch.long, device=device))
                cache[:, 1:] = cache[:, :1]
                for name, buffer in token_model.named_buffers():
                    if name.endswith("piecewise_index_cache"):
                        buffer[1:] = buffer[:1]
                expected = None
                if reference is not None and latent:
                    expected = torch.cat([reference(input_ids=ids[s : s + 1], use_cache=False,
                                                    logits_to_keep=1).logits[:, -1] for s in range(min(2, widest))])
                positions = torch.full((widest,), ctx, device=device)
                for b in fits:
                    slots = torch.arange(b, device=device)

                    def step(b=b, slots=slots):
                        return runner(ids[:b, ctx], positions[:b], cache, slots)

                    error = rel_error(step()[: expected.shape[0]], expected[:b]) if expected is not None else None
                    ms = timed(step, sync, rounds, iters)
                    floor = step_floor_bytes(model, b, ctx, row_bytes) / HBM * 1e3
                    result["decode"].append({"cache": label, "context": ctx, "batch": b, "ms": ms, "floor_ms": floor,
                                             "rel_error": error, "frontend": runner.stats["frontend"],
                                             "graph_mode": runner.stats["graph_mode"], "compiler": args.compiler,
                                             "reason": runner.stats["frontend_reason"]})
                    progress(f"{label}, context {ctx}, B={b}: {ms:.3f} ms (floor {floor:.3f}), rel. error {error}")
                    if b == args.profile and latent and args.out:
                        from torch.profiler import ProfilerActivity, profile

                        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                            for _ in range(10):
                                step()
                            sync()
                        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
                        (args.out / f"profile-{args.model}-B{b}-{ctx}.txt").write_text(table)
                    write()
                del runner, cache, step
                if device == "cuda":
                    torch.cuda.empty_cache()
            for length in prefills if latent else prefills[:1]:
                ids = torch.randint(0, c.vocab_size, (length,), device=device)
                cache = token_model.make_kv_cache(max_seq_len=length, dtype=dtype_of_cache)
                positions = torch.arange(length, device=device)
                try:
                    ms = timed(lambda: token_model(ids, positions, cache), sync, 1, 2)  # over max_tokens: no graphs
                except torch.OutOfMemoryError:
                    ms = None
                row = {"cache": label, "tokens": length, "ms": ms}
                if latent and not getattr(c, "index_topk", None):  # dense MLA: each path forced, for the threshold
                    for path, threshold in (("absorbed_ms", 1 << 30), ("up_projected_ms", 0)):
                        chosen, mla.UP_PROJECT_TOKENS = mla.UP_PROJECT_TOKENS, threshold
                        try:
                            row[path] = timed(lambda: token_model(ids, positions, cache), sync, 1, 2)
                        except torch.OutOfMemoryError:
                            row[path] = None
                        finally:
                            mla.UP_PROJECT_TOKENS = chosen
                if latent and reference is not None:
                    try:
                        row["transformers_ms"] = timed(lambda: reference(input_ids=ids[None], use_cache=False,
                                                                         logits_to_keep=1), sync, 1, 2)
                    except torch.OutOfMemoryError:
                        row["transformers_ms"] = None
                result["prefill"].append(row)
                progress(f"prefill {length} tokens, {label}: {row}")
                del cache
                if device == "cuda":
                    torch.cuda.empty_cache()
                write()
    write()
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = ["# MLA decode and prefill over the latent cache", "", *(f"- {k}: {v}" for k, v in meta.items()), ""]
    cache = result["cache"]
    if cache:
        lines += ["| cache | bytes per token and layer | most sequences in 120 GiB beside the weights |", "|---|---|---|"]
        for kind in ("latent", "latent fp8", "per-head"):
            if kind in cache:
                fits = ", ".join(f"{n} at {ctx}" for ctx, n in cache[kind]["largest_batch"].items())
                lines.append(f"| {kind} | {cache[kind]['bytes_per_token_per_layer']:.0f} | {fits} |")
        lines += [f"- weights: {cache['weights_bytes'] / 2**30:.2f} GiB", ""]
    lines += ["| cache | context | B | ms per step | floor ms | rel. error | front-end |", "|---|---|---|---|---|---|---|"]
    for r in result["decode"]:
        error = f"{r['rel_error']:.1e}" if r["rel_error"] is not None else "-"
        lines.append(f"| {r['cache']} | {r['context']} | {r['batch']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | {error} "
                     f"| {r['frontend']}, {r['graph_mode']}, compiler {_compiler(r)} |")
    lines += ["", "| cache | prefill tokens | piecewise ms | transformers ms (no cache) | dense MLA: absorbed ms | "
              "up-projected ms |", "|---|---|---|---|---|---|"]
    for r in result["prefill"]:
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        lines.append(f"| {r['cache']} | {r['tokens']} | {fmt(r['ms'])} | {fmt(r.get('transformers_ms'))} | "
                     f"{fmt(r.get('absorbed_ms'))} | {fmt(r.get('up_projected_ms'))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    START = time.perf_counter()
    raise SystemExit(main())
