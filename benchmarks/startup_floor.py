"""What torch alone costs a process at start, for the models of ``startup.py``: the floor under piecewise's first call.

    PYTHONPATH=src python benchmarks/startup_floor.py --out DIR [--cases l16,hf] [--tiny]

Each case runs in two fresh processes sharing one new folder for Inductor's and Triton's caches and Python's
bytecode (``startup.py``'s set-up); the second finds them warm. Per process:
- ``import_s``: ``import torch``; ``inductor_import_s``: ``import torch._inductor.compile_fx`` after it;
- ``compile_s``: plain ``torch.compile(model, dynamic=True)`` (Inductor, one graph for every token count), its first
  call at the largest decode batch: Dynamo's trace, the backend and Inductor's cached kernels, no CUDA graph;
- ``capture_s`` (CUDA): the eager model captured whole as one CUDA graph per size of vLLM's ladder to 512 (51 sizes),
  one warm-up run per size, one memory pool: what capturing 51 sizes costs without any check or cut.
Writes startup_floor.md and startup_floor.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

started_process = time.perf_counter()
import torch  # noqa: E402, F401 - timed: what a process pays to import it

IMPORT_S = time.perf_counter() - started_process
sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import build, report_meta, run_child, sync, write_report  # noqa: E402


def child(case: str, tiny: bool) -> dict:
    began = time.perf_counter()
    import torch._inductor.compile_fx  # noqa: F401

    inductor_import = time.perf_counter() - began
    from piecewise.config import vllm_sizes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, first_args, _ = build("l16-dynamo" if case == "l16" else "hf-default", tiny, device, dtype)
    row = {"case": case, "import_s": IMPORT_S, "inductor_import_s": inductor_import}
    with torch.inference_mode():
        compiled = torch.compile(model, dynamic=True)
        sync()
        began = time.perf_counter()
        compiled(*first_args)
        sync()
        row["compile_s"] = time.perf_counter() - began
        if device == "cuda":
            sizes = vllm_sizes(512)
            if case == "l16":  # a sequence per token: a cache of 512 sequences
                cache = model.make_kv_cache(sizes[-1])
                arguments = {s: (first_args[0].new_zeros(s), first_args[1].new_full((s,), 1), cache) for s in sizes}
            else:  # the transformers model's cache holds 32 sequences: the tokens share them
                arguments = {s: (first_args[0].new_zeros(s), first_args[1].new_full((s,), 1), first_args[2],
                                 torch.arange(s, device=device) % first_args[3].shape[0]) for s in sizes}
            pool, graphs = torch.cuda.graph_pool_handle(), []
            sync()
            began = time.perf_counter()
            try:
                for size in reversed(sizes):
                    model(*arguments[size])
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        model(*arguments[size])
                    graphs.append(graph)
                sync()
                row["capture_s"] = time.perf_counter() - began
                row["sizes"] = len(sizes)
            except RuntimeError as exc:
                row["capture_error"] = str(exc).splitlines()[0][:200]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cases", default="l16,hf")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tiny)), flush=True)
        return 0
    rows = []
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory(prefix="piecewise-floor-") as folder:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor"),
                   "TRITON_CACHE_DIR": os.path.join(folder, "triton"),
                   "PYTHONPYCACHEPREFIX": os.path.join(folder, "pycache")}
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            for run in ("cold", "warm"):
                command = [sys.executable, __file__, "--child", case] + (["--tiny"] if args.tiny else [])
                rows.append(run_child(command, env, run))
    meta = report_meta("startup_floor.py")
    lines = [f"# What torch alone costs at start ({meta['date']})", "",
             f"`{meta['command']}` · torch {meta['torch']} · {meta['device']}", "",
             "| case | process | import torch s | import Inductor s | torch.compile first call s | "
             "capture, whole graphs s | sizes | process s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        capture = f"{r['capture_s']:.2f}" if "capture_s" in r else r.get("capture_error", "–")
        lines.append(f"| {r['case']} | {r['run']} | {r['import_s']:.2f} | {r['inductor_import_s']:.2f} | "
                     f"{r['compile_s']:.2f} | {capture} | {r.get('sizes', '–')} | {r['process_s']:.1f} |")
    return write_report(args.out, "startup_floor", lines, meta, rows)


if __name__ == "__main__":
    sys.exit(main())
