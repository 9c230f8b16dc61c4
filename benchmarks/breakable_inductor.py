"""Breakable with Inductor regions against Dynamo with Inductor pieces, on a model Dynamo cannot take whole.

    PYTHONPATH=src python benchmarks/breakable_inductor.py --out DIR [--model l16|hf|both] [--tag cold]
    PYTHONPATH=src python benchmarks/breakable_inductor.py --tiny          # small shapes, any device

The seed's case: a JIT kernel library's first-use check (a cached subprocess under a lock, what Dynamo cannot
trace) in every layer's MLP, before its norm. Two models, bf16 on CUDA, decode steps of B sequences:
- ``l16``: the bundled 16-layer decode model (``models.decode.L16``), its KV cache at full length;
- ``hf``: a transformers Llama of Llama-3.2-1B's shapes (``configs/llama-3.2-1b``, random weights) through
  ``TokenModel``, 512 cached tokens per sequence.
Variants, each with default graph modes (full graphs for decode where the attention is capturable):
``dynamo+inductor`` on the model *without* the JIT call (the fastest a model Dynamo can take runs),
``breakable+inductor`` and ``breakable`` (eager pieces) on the model *with* it. Reported: ms per step (median of
rounds taken in turn), first-call seconds (a second process with ``--tag warm`` measures them with Inductor's
caches warm), regions compiled, rel. error against eager. Writes breakable_inductor-<model>-<tag>.md / .json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import piecewise

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from decode_step import round_robin_ms  # noqa: E402

BATCHES = (1, 8, 32, 128)
_LOCK = threading.Lock()


@functools.cache
def toolkit_version() -> str:
    """What JIT kernel libraries do on first use: run the toolkit and parse its banner (cached)."""
    return subprocess.check_output([sys.executable, "-c", "print('release 12.8')"], text=True).strip()


class Checked(torch.nn.Module):
    """``module`` behind a JIT library's check: the lock is taken on every call (Dynamo cannot trace it)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.inner = module

    def forward(self, x):
        with _LOCK:
            toolkit_version()
        return self.inner(x)


def add_jit(layers, attr: str) -> None:
    for layer in layers:
        setattr(layer, attr, Checked(getattr(layer, attr)))


def build(kind: str, tiny: bool, device: str, dtype: torch.dtype):
    """(model to compile, its decode steps {B: args}, its layers (a function of the model) and the attribute to put
    the JIT call on)."""
    torch.manual_seed(0)
    batches = (1, 3) if tiny else BATCHES
    if kind == "l16":
        from piecewise.models.decode import L16, DecodeLlama
        from piecewise.models.llama import LlamaConfig

        config = LlamaConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                             intermediate_size=128, max_seq_len=32) if tiny else L16
        model = DecodeLlama(config).to(device, dtype).eval()
        cache = model.make_kv_cache(max(batches))
        cache.normal_()
        steps = {b: (torch.randint(0, config.vocab_size, (b,), device=device),
                     torch.full((b,), config.max_seq_len - 1, device=device), cache) for b in batches}
        return model, steps, lambda m: m.layers, "post_norm"
    from transformers import AutoConfig, AutoModelForCausalLM

    from piecewise.bench import transformers_calls
    from piecewise.integrations.transformers import TokenModel, enable

    config = AutoConfig.from_pretrained(ROOT / "configs" / "llama-3.2-1b")
    if tiny:
        config.num_hidden_layers, config.hidden_size, config.intermediate_size = 2, 64, 128
        config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size = 4, 2, 16, 256
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    token_model = TokenModel(enable(model))
    calls = transformers_calls(token_model, list(batches), [], 24 if tiny else 512)
    return token_model, {c.tokens: c.args for c in calls}, lambda m: m.model.model.layers, "post_attention_layernorm"


VARIANTS = (  # name, with the JIT call, CaptureConfig fields
    ("dynamo+inductor, no JIT call", False, dict(frontend="dynamo", compiler="inductor")),
    ("breakable+inductor, JIT call", True, dict(frontend="breakable", compiler="inductor")),
    ("breakable, JIT call", True, dict(frontend="breakable", compiler="eager")),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", default="both", choices=("l16", "hf", "both"))
    parser.add_argument("--tag", default="cold", help="a name for this process's run (cold, warm)")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kinds = ("l16", "hf") if args.model == "both" else (args.model,)
    for kind in kinds:
        model, steps, layers_of, attr = build(kind, args.tiny, device, dtype)
        with_jit = build(kind, args.tiny, device, dtype)[0]  # the same weights (same seed), the JIT call added
        with_jit.load_state_dict(model.state_dict())
        add_jit(layers_of(with_jit), attr)
        batches = sorted(steps)
        top = max(batches)
        with torch.inference_mode():
            reference = {b: model(*steps[b]).float() for b in batches}  # the same numbers with or without the call
        rows, timed = {}, {}
        for name, jit, fields in VARIANTS:
            runner = piecewise.compile(with_jit if jit else model, piecewise.CaptureConfig(max_tokens=top, **fields))
            started = time.perf_counter()
            with torch.inference_mode():
                runner(*steps[top])
                if device == "cuda":
                    torch.cuda.synchronize()
                first = time.perf_counter() - started
                errors = {b: float((runner(*steps[b]).float() - reference[b]).norm() / reference[b].norm())
                          for b in batches}
            stats = runner.stats
            rows[name] = {"first_call_s": first, "rel_error": errors, "frontend": stats["frontend"],
                          "graph_mode": stats["graph_mode"], "compiled_regions": stats["compiled_regions"],
                          "pieces": stats["pieces"], "graphs": stats["graphs"], "full_graphs": stats["full_graphs"]}
            for b in batches:
                timed[(name, b)] = lambda runner=runner, b=b: runner(*steps[b])
            print(json.dumps({name: rows[name]}), flush=True)
        with torch.inference_mode():
            ms = round_robin_ms(timed) if device == "cuda" else {key: 0.0 for key in timed}  # a CPU: a dry run
        for (name, b), value in ms.items():
            rows[name].setdefault("ms", {})[b] = value
        write(args, kind, device, rows, batches)
    return 0


def write(args, kind: str, device: str, rows: dict, batches: list[int]) -> None:
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "command": "PYTHONPATH=src python benchmarks/breakable_inductor.py " + " ".join(sys.argv[1:]),
            "model": kind + (" (tiny)" if args.tiny else ""), "tag": args.tag}
    fastest = rows[VARIANTS[0][0]].get("ms", {})
    lines = [f"# Breakable with Inductor regions, {meta['model']} decode step ({meta['date']}, {args.tag})", "",
             f"`{meta['command']}` · torch {meta['torch']} · {meta['device']}", "",
             "| variant | " + " | ".join(f"B={b} ms" for b in batches) + " | first call s | regions | graph mode "
             "| max rel. error |", "|---|" + "---|" * (len(batches) + 4)]
    for name, row in rows.items():
        cells = []
        for b in batches:
            value = row.get("ms", {}).get(b, 0.0)
            ratio = f" ({value / fastest[b]:.2f}×)" if fastest.get(b) else ""
            cells.append(f"{value:.3f}{ratio}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['first_call_s']:.1f} | {row['compiled_regions']} "
                     f"| {row['graph_mode']} | {max(row['rel_error'].values()):.1e} |")
    lines += ["", "Ratios: against dynamo+inductor on the model without the JIT call."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"breakable_inductor-{kind}-{args.tag}"
        (args.out / f"{stem}.md").write_text(text)
        (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
