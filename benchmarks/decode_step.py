"""Decode-step latency on the "L16" model: eager, full CUDA graph, hand-made piecewise floor, piecewise
(eager pieces), piecewise (inductor pieces), piecewise (breakable front-end), torch.compile reduce-overhead; plus
capture time and pool bytes.

    PYTHONPATH=src python benchmarks/decode_step.py --out DIR [--nvfp4] [--skip-inductor] [--gc-freeze]

``--nvfp4`` runs the model with every Linear but the output head as ``NVFP4Linear`` (W4A16), and adds the full
CUDA graph of the same model with its bf16 weights for comparison.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch

import piecewise
from piecewise.models.decode import L16, DecodeLlama
from piecewise.models.llama import rotary_tables
from piecewise.opaque import opaque_op_info

BATCHES = (1, 8, 32, 128)


ITERS, ROUNDS = 50, 11


def sample_ms(fn, iters: int = ITERS) -> float:
    """Host-inclusive time per call over ``iters`` back-to-back calls (launch overhead is the point)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def round_robin_ms(steps: dict, rounds: int = ROUNDS) -> dict:
    """Median per variant of ``rounds`` samples taken in turn (variant A, B, C, A, B, C, ...), so clock and
    host drift hit every variant alike, and a spell of host contention lands in few samples of each."""
    for fn in steps.values():
        for _ in range(5):
            fn()
    samples = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            samples[name].append(sample_ms(fn))
    return {name: statistics.median(values) for name, values in samples.items()}


def inputs(batch: int, cache: torch.Tensor, vocab: int):
    generator = torch.Generator(device="cuda").manual_seed(batch)
    ids = torch.randint(0, vocab, (batch,), device="cuda", generator=generator)
    positions = torch.full((batch,), L16.max_seq_len - 1, device="cuda", dtype=torch.long)
    return ids, positions, cache


def full_graph(model, ids, positions, cache):
    static = (ids.clone(), positions.clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(*static, cache)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(*static, cache)

    def step():
        graph.replay()

    step.keep_alive = static  # the graph reads these addresses: they must outlive it
    return step, out


def hand_piecewise(model, ids, positions, cache):
    """The floor: one graph per region between attentions, written by hand; attention eager in between,
    its output copied into the next graph's static input (what any piecewise runtime must at least do)."""
    layers = model.layers
    batch = ids.shape[0]
    x_in = model.embed(ids)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs, qkv_out, attn_in, resid = [], [], [], []
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            x = model.embed(ids)
            rotary = rotary_tables(positions, L16.head_dim, L16.rope_theta)
            qkv = layers[0].pre_attention(x, rotary)
        graphs.append(graph)
        qkv_out.append(qkv)
        resid.append(x)
        for i, layer in enumerate(layers):
            attended = torch.zeros(batch, L16.num_heads * L16.head_dim, device="cuda", dtype=x_in.dtype)
            attn_in.append(attended)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                x = layer.post_attention(resid[i], attended)
                if i + 1 < len(layers):
                    qkv = layers[i + 1].pre_attention(x, rotary)
                else:
                    out = model.lm_head(model.norm(x))
            graphs.append(graph)
            qkv_out.append(qkv)
            resid.append(x)
    torch.cuda.current_stream().wait_stream(stream)

    attend = opaque_op_info("piecewise_examples::decode_attention").impl  # the op's body, no dispatcher

    def step():
        graphs[0].replay()
        for i in range(len(layers)):
            q, k, v = qkv_out[i]
            attn_in[i].copy_(attend(q, k, v, positions, cache, i))
            graphs[i + 1].replay()

    step.keep_alive = (ids, positions)  # read by the captured graphs
    return step, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for decode_step.json and decode_step.md")
    parser.add_argument("--skip-inductor", action="store_true")
    parser.add_argument(
        "--gc-freeze", action="store_true",
        help="gc.freeze() after set-up, before timing (as serving engines do after start-up)",
    )
    parser.add_argument("--nvfp4", action="store_true", help="NVFP4 weights (every Linear but lm_head)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("decode_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = DecodeLlama(L16).to(device="cuda", dtype=torch.bfloat16).eval()
    bf16_model = None
    if args.nvfp4:
        from piecewise.kernels.nvfp4 import quantize_linears

        bf16_model = DecodeLlama(L16).to(device="cuda", dtype=torch.bfloat16).eval()
        bf16_model.load_state_dict(model.state_dict())
        quantize_linears(model)
    cache = model.make_kv_cache(max(BATCHES))
    cache.normal_()
    results: dict[str, dict[int, float]] = {}
    errors: dict[str, dict[int, float]] = {}

    def record_error(variant, batch, out, ref):
        errors.setdefault(variant, {})[batch] = float((out.float() - ref.float()).norm() / ref.float().norm())

    refs = {}
    steps: dict[int, dict] = {b: {} for b in BATCHES}  # batch → variant → step function
    with torch.no_grad():
        for batch in BATCHES:
            ids, positions, _ = inputs(batch, cache, L16.vocab_size)
            refs[batch] = model(ids, positions, cache).clone()
            steps[batch]["eager"] = lambda ids=ids, positions=positions: model(ids, positions, cache)
            step, out = full_graph(model, ids, positions, cache)
            step()
            record_error("full graph", batch, out, refs[batch])
            steps[batch]["full graph"] = step
            step, out = hand_piecewise(model, ids, positions, cache)
            step()
            record_error("hand piecewise (floor)", batch, out, refs[batch])
            steps[batch]["hand piecewise (floor)"] = step
            if bf16_model is not None:
                step, out = full_graph(bf16_model, ids, positions, cache)
                step()
                steps[batch]["full graph, bf16 weights"] = step

    capture = {}
    runners = []
    variants = [("breakable", "eager"), ("dynamo", "eager")] + ([] if args.skip_inductor else [("dynamo", "inductor")])
    variants = [(*v, mode) for mode in ("piecewise", "full_and_piecewise") for v in variants]
    for frontend, compiler, mode in variants:
        name = "piecewise (breakable)" if frontend == "breakable" else f"piecewise ({compiler} pieces)"
        name = name if mode == "piecewise" else name.replace("piecewise (", "full_and_piecewise (")
        config = piecewise.CaptureConfig(max_tokens=512, compiler=compiler, frontend=frontend, graph_mode=mode,
                                         max_decode_batch=max(BATCHES))
        runner = piecewise.compile(model, config)
        runners.append(runner)
        ids, positions, _ = inputs(max(BATCHES), cache, L16.vocab_size)
        started = time.perf_counter()
        runner.capture(ids, positions, cache)
        first = time.perf_counter() - started
        stats = runner.stats
        capture[name] = {
            "sizes": len(stats["captured_sizes"]),
            "capture_seconds": stats["capture_seconds"],
            "first_call_seconds": first,
            "compile_seconds": stats["compile_seconds"],
            "pool_bytes": stats["pool_bytes"],
            "graphs": stats["graphs"],
            "pieces": stats["pieces"],
            "traces": stats["traces"],
            "graph_mode": stats["graph_mode"],
            "full_graphs": stats["full_graphs"],
        }
        for batch in BATCHES:
            ids, positions, _ = inputs(batch, cache, L16.vocab_size)
            out = runner(ids, positions, cache)
            record_error(name, batch, out, refs[batch])
            steps[batch][name] = lambda r=runner, ids=ids, positions=positions: r(ids, positions, cache)

    if not args.skip_inductor:
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
        name = "reduce-overhead"
        with torch.no_grad():
            for batch in BATCHES:
                ids, positions, _ = inputs(batch, cache, L16.vocab_size)
                started = time.perf_counter()
                out = compiled(ids, positions, cache)
                out = compiled(ids, positions, cache)
                out = compiled(ids, positions, cache).clone()
                capture.setdefault(name, {})[f"first_calls_seconds_B{batch}"] = time.perf_counter() - started
                record_error(name, batch, out, refs[batch])
                steps[batch][name] = lambda ids=ids, positions=positions: compiled(ids, positions, cache)

    if args.gc_freeze:
        gc.collect()
        gc.freeze()  # Python's collector no longer walks the compiled artifacts on every collection
    with torch.no_grad():  # one round samples every (batch, variant) pair once
        every = {(batch, variant): fn for batch in BATCHES for variant, fn in steps[batch].items()}
        for (batch, variant), ms in round_robin_ms(every).items():
            results.setdefault(variant, {})[batch] = ms
    for name, runner in zip(capture, runners):
        capture[name]["traces_after_all_batches"] = runner.stats["traces"]

    meta = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "command": "PYTHONPATH=src python benchmarks/decode_step.py " + " ".join(sys.argv[1:]),
        "model": "L16: hidden 2048, 16 q / 4 kv heads, head_dim 128, FFN 5632, 16 layers, bf16, KV context 1024",
        "weights": "NVFP4 (every Linear but lm_head), W4A16" if args.nvfp4 else "bf16",
        "gc": "frozen after set-up" if args.gc_freeze else "default (not frozen)",
    }
    lines = [
        "# Decode step, L16 model",
        "",
        *(f"- {k}: {v}" for k, v in meta.items()),
        "",
        f"ms per step (host-inclusive wall time: median of {ROUNDS} samples of {ITERS} calls; each round samples every "
        "batch and variant in turn); "
        "rel. error vs eager in brackets",
        "",
        "| variant | " + " | ".join(f"B={b}" for b in BATCHES) + " |",
        "|---|" + "---|" * len(BATCHES),
    ]
    for variant, row in results.items():
        cells = []
        for b in BATCHES:
            err = errors.get(variant, {}).get(b)
            cells.append(f"{row[b]:.3f}" + (f" ({err:.1e})" if err is not None else ""))
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    floor = results["hand piecewise (floor)"]
    lines += ["", "Targets:"]
    if "piecewise (eager pieces)" in results:
        ratio = results["piecewise (eager pieces)"][1] / floor[1]
        lines.append(f"- piecewise(eager)/floor at B=1: {ratio:.3f} (target ≤ 1.05)")
    if "piecewise (breakable)" in results and "piecewise (eager pieces)" in results:
        for b in BATCHES:
            ratio = results["piecewise (breakable)"][b] / results["piecewise (eager pieces)"][b]
            lines.append(f"- B={b}: breakable / dynamo-eager {ratio:.3f} (target ≤ 1.03)")
    if "piecewise (inductor pieces)" in results and "reduce-overhead" in results:
        for b in BATCHES:
            best = min(results["full graph"][b], results["reduce-overhead"][b])
            mine = results["piecewise (inductor pieces)"][b]
            lines.append(f"- B={b}: piecewise(inductor) {mine:.3f} vs min(full graph, reduce-overhead) {best:.3f}")
    for variant in [v for v in results if v.startswith("full_and_piecewise")]:
        for b in BATCHES:
            piece = results.get(variant.replace("full_and_piecewise", "piecewise"), {}).get(b)
            lines.append(f"- B={b}: {variant} / full graph {results[variant][b] / results['full graph'][b]:.3f} "
                         f"(target ≤ 0.95 with inductor), / piecewise {results[variant][b] / piece:.3f} (target ≤ 1)"
                         if piece else f"- B={b}: {variant} {results[variant][b]:.3f}")
    lines += ["", "Capture (51 sizes, max_tokens 512):", ""]
    for name, info in capture.items():
        lines.append(f"- {name}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items()))
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_step.json"), "w") as f:
            json.dump({"meta": meta, "ms": results, "rel_error": errors, "capture": capture}, f, indent=2)
        with open(os.path.join(args.out, "decode_step.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
