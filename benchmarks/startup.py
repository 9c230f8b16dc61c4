"""A process's first call, cold and with the persistent cache warm: each case runs in two fresh processes that
share one new cache directory (``PIECEWISE_CACHE_DIR``, Triton's too, and a Python bytecode folder,
``PYTHONPYCACHEPREFIX``, as an install with compiled bytecode has), the first finding it empty.

    PYTHONPATH=src python benchmarks/startup.py --out DIR [--cases l16-inductor,hf-auto,...] [--profile]
    PYTHONPATH=src python benchmarks/startup.py --tiny             # small shapes, any device

Cases (bf16 on CUDA, default graph modes, under ``torch.inference_mode()``):
- ``l16-dynamo`` / ``l16-breakable`` / ``l16-inductor``: the bundled 16-layer decode model, 51 sizes (vLLM's
  ladder to 512), each front-end with the default compiler (``"auto"``), and Dynamo with Inductor pieces
  (``compiler="inductor"``); ``l16-breakable-eager``: breakable with eager pieces (nothing compiles);
- ``hf-default`` / ``hf-auto`` / ``hf-inductor``: a transformers Llama of Llama-3.2-1B's shapes
  (``configs/llama-3.2-1b``, random weights) through ``TokenModel``, 512 cached tokens per sequence, with the
  default ``CaptureConfig`` / ``compiler="auto"`` / ``compiler="inductor"``.
Reported per process: the first call's seconds and where they went (compile, capture, warm-up, verify), the
cache's answer, the mode taken and why, the ``compiler="auto"`` table, and ms per step at B = 1, 8, 32.
``--profile``: a third process, warm, with its first call under cProfile (top 25 by own time, piecewise's functions by
cumulative time (70), the callers of ``compile``; on stderr; not in
the table).
Writes startup.md and startup.json.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
CASES = ("l16-dynamo", "l16-breakable", "l16-breakable-eager", "l16-inductor", "hf-default", "hf-auto", "hf-inductor")
BATCHES = (1, 8, 32)


def config_of(case: str):
    import piecewise

    settings = {"l16-dynamo": {"frontend": "dynamo"}, "l16-breakable": {"frontend": "breakable"},
                "l16-breakable-eager": {"frontend": "breakable", "compiler": "eager"},
                "l16-inductor": {"frontend": "dynamo", "compiler": "inductor"}, "hf-default": {},
                "hf-auto": {"compiler": "auto"}, "hf-inductor": {"compiler": "inductor"}}[case]
    return piecewise.CaptureConfig(max_tokens=512, **settings)


def build(case: str, tiny: bool, device: str, dtype: torch.dtype):
    """(model, first call's arguments, arguments of a B-sequence decode step)."""
    torch.manual_seed(0)
    if case.startswith("l16"):
        from piecewise.models.decode import L16, DecodeLlama, LlamaConfig

        shape = LlamaConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=128, max_seq_len=64) if tiny else L16
        model = DecodeLlama(shape).to(device=device, dtype=dtype).eval()
        cache = model.make_kv_cache(256)  # a sequence per token up to the full graphs' top (max_decode_batch)

        def step(b):
            return (torch.randint(0, shape.vocab_size, (b,), device=device),
                    torch.full((b,), shape.max_seq_len - 1, device=device), cache)

        return model, step(max(BATCHES)), step
    from transformers import AutoConfig, AutoModelForCausalLM

    from piecewise.integrations.transformers import TokenModel, enable

    config = AutoConfig.from_pretrained(ROOT / "configs" / "llama-3.2-1b")
    if tiny:
        config.num_hidden_layers, config.hidden_size, config.intermediate_size = 2, 64, 128
        config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size = 4, 2, 16, 256
    with torch.device(device):
        model = TokenModel(enable(AutoModelForCausalLM.from_config(config, dtype=dtype).eval()))
    context = 64 if tiny else 512
    cache = model.make_kv_cache(context + 8, sequences=max(BATCHES), device=device)

    def step(b):
        return (torch.randint(0, config.vocab_size, (b,), device=device),
                torch.full((b,), context, device=device), cache, torch.arange(b, device=device))

    return model, step(max(BATCHES)), step


def child(case: str, tiny: bool, profile: bool) -> dict:
    import piecewise

    began = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, first_args, step = build(case, tiny, device, dtype)
    built = time.perf_counter() - began
    runner = piecewise.compile(model, config_of(case))
    profiler = cProfile.Profile() if profile else None
    with torch.inference_mode():
        sync()
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        runner.capture(*first_args)
        sync()
        if profiler:
            profiler.disable()
            report = pstats.Stats(profiler, stream=sys.stderr)
            report.sort_stats("tottime").print_stats(25)
            report.sort_stats("cumulative").print_stats(60)
            report.sort_stats("cumulative").print_stats(r"piecewise|builtins.compile|_dynamo/eval_frame", 70)
            report.print_callers(r"builtins.compile")
        first = time.perf_counter() - started
        ms = {b: step_ms(runner, step(b)) for b in BATCHES}
    stats = runner.stats
    return {"case": case, "first_call_s": first, "build_s": built, "cache": stats.cache, "frontend": stats.frontend,
            "frontend_reason": stats.frontend_reason, "graph_mode": stats.graph_mode,
            "compile_s": stats.compile_seconds, "pieces_shared": stats.pieces_shared, "capture_s": stats.capture_seconds,
            "prewarm_s": stats.prewarm_seconds, "verify_s": stats.verify_seconds, "graphs": stats.graphs,
            "full_graphs": stats.full_graphs, "sizes": len(stats.captured_sizes),
            "candidates": stats.candidates, "phases": stats.first_call_seconds, "dynamo": dynamo_seconds(), "ms": ms}


def dynamo_seconds() -> dict:
    """Dynamo's own timers (``torch._dynamo.utils.compile_times``), summed over its compiles: its trace is
    ``_compile.compile_inner`` less ``OutputGraph.call_user_compiler`` (the backend: split and pieces)."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return {name: round(float(value), 3) for name, value in zip(names, values)
            if name in ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler",
                        "build_guards", "compile_fx_inner", "inductor_compile", "aot_collect_metadata")}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_ms(runner, args, rounds: int = 5, iters: int = 20) -> float:
    for _ in range(3):
        runner(*args)
    samples = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            runner(*args)
        sync()
        samples.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tiny, args.profile_child)), flush=True)
        return 0
    rows = []
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory(prefix="piecewise-startup-") as folder:
            env = {**os.environ, "PIECEWISE_CACHE_DIR": folder, "TRITON_CACHE_DIR": os.path.join(folder, "triton")}
            # A pip install of torch carries compiled bytecode; a read-only site-packages without it compiles ~640
            # modules in every process (2 s on the H200's host). The processes share a bytecode folder instead.
            env["PYTHONPYCACHEPREFIX"] = os.path.join(folder, "pycache")
            env.pop("PYTHONDONTWRITEBYTECODE", None)  # the cold process writes it (a profile still showed ~660)
            for run in ("cold", "warm") + (("profiled",) if args.profile else ()):
                command = [sys.executable, __file__, "--child", case] + (["--tiny"] if args.tiny else []) + \
                    (["--profile-child"] if run == "profiled" else [])
                row = run_child(command, env, run)
                if run != "profiled":
                    rows.append(row)
    meta = report_meta("startup.py")
    lines = [f"# First call, cold and with the cache warm ({meta['date']})", "",
             f"`{meta['command']}` · torch {meta['torch']} · {meta['device']}", "",
             "| case | process | cache | first call s | compile s | pieces shared | capture s | warm-up s | mode | "
             + " | ".join(f"B={b} ms" for b in BATCHES) + " | process s |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(BATCHES) + "---|"]
    for r in rows:
        mode = r["frontend"] + ("+" + r["graph_mode"] if r["graph_mode"] else "")
        lines.append(f"| {r['case']} | {r['run']} | {r['cache']} | {r['first_call_s']:.2f} | {r['compile_s']:.2f} | "
                     f"{r['pieces_shared']} | {r['capture_s']:.2f} | {r['prewarm_s']:.2f} | {mode} | "
                     + " | ".join(f"{r['ms'][str(b)]:.3f}" for b in BATCHES) + f" | {r['process_s']:.1f} |")
    lines += ["", "Where each first call went (s, `stats.first_call_seconds`; the rest of the first call is the call "
              "itself after them):", ""]
    lines += [f"- {r['case']} {r['run']}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()) for r in rows]
    lines += ["", "Dynamo's own timers (s, summed over its compiles):", ""]
    lines += [f"- {r['case']} {r['run']}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["dynamo"].items())
              for r in rows if r["dynamo"]]
    lines += ["", "Why each mode (the warm process):", ""]
    lines += [f"- {r['case']}: {r['frontend_reason'] or '(as configured)'}" for r in rows if r["run"] == "warm"]
    return write_report(args.out, "startup", lines, meta, rows)


def run_child(command: list[str], env: dict[str, str], run: str) -> dict:
    """A fresh process's row (the last line it prints, JSON), with ``run`` and the process's seconds; printed."""
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env, check=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row.update(run=run, process_s=time.perf_counter() - started)
    print(json.dumps(row), flush=True)
    return row


def report_meta(script: str) -> dict:
    """Date, torch, device and the command that ran ``benchmarks/<script>``."""
    return {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "command": f"PYTHONPATH=src python benchmarks/{script} " + " ".join(sys.argv[1:])}


def write_report(out: Path | None, stem: str, lines: list[str], meta: dict, rows: list[dict]) -> int:
    """Print the table; with ``out``, write it to ``stem``.md and the rows to ``stem``.json."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.md").write_text(text)
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
