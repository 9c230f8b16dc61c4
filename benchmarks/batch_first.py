"""A gpt-fast-shaped model called as gpt-fast calls it: ids [1, T], positions [T], KV caches in module buffers
written at ``input_pos``, SDPA over the whole cache with a causal mask row per position. Decode steps (one token)
and an 8-token extend, eager against ``piecewise.compile(model)`` with default settings (the token dimension of
``idx`` found by itself), with ``compiler="eager"`` and with the breakable front-end's Inductor regions, and for
decode gpt-fast's own fast path (the model compiled whole with ``torch.compile(mode="reduce-overhead",
fullgraph=True)``); outputs compared with eager.

    PYTHONPATH=src python benchmarks/batch_first.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import piecewise

sys.path.insert(0, os.path.dirname(__file__))
from decode_step import round_robin_ms  # noqa: E402

WIDTH, HEADS, LAYERS, VOCAB, MAX_SEQ = 2048, 32, 16, 32000, 1024


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = WIDTH // HEADS
        self.wqkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.wo = nn.Linear(WIDTH, WIDTH, bias=False)
        self.w13 = nn.Linear(WIDTH, 2 * 5632, bias=False)
        self.w2 = nn.Linear(5632, WIDTH, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH)
        self.register_buffer("k", torch.zeros(1, HEADS, MAX_SEQ, self.head_dim))
        self.register_buffer("v", torch.zeros(1, HEADS, MAX_SEQ, self.head_dim))

    def forward(self, x, mask, pos):
        batch, tokens, _ = x.shape
        q, k, v = (t.view(batch, tokens, HEADS, self.head_dim).transpose(1, 2)
                   for t in self.wqkv(self.norm1(x)).split(WIDTH, -1))
        self.k[:, :, pos] = k
        self.v[:, :, pos] = v
        y = F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask)
        x = x + self.wo(y.transpose(1, 2).reshape(batch, tokens, WIDTH))
        gate, up = self.w13(self.norm2(x)).chunk(2, -1)
        return x + self.w2(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm, self.out = nn.RMSNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool)))

    def forward(self, idx, input_pos):
        mask = self.causal[None, None, input_pos]
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x, mask, input_pos)
        return self.out(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    out_dir = parser.parse_args().out
    torch.manual_seed(0)
    model = Transformer().to("cuda", torch.bfloat16).eval()
    prompt = torch.randint(0, VOCAB, (1, 512), device="cuda")
    one = torch.randint(0, VOCAB, (1, 1), device="cuda")
    eight = torch.randint(0, VOCAB, (1, 8), device="cuda")
    at = {1: torch.tensor([600], device="cuda"), 8: torch.arange(600, 608, device="cuda")}
    rows = []
    with torch.no_grad():
        model(prompt, torch.arange(512, device="cuda"))
        runners = {}
        for name, config in (("default", piecewise.CaptureConfig(max_tokens=64, cache_dir=None)),
                             ("compiler='eager'", piecewise.CaptureConfig(max_tokens=64, cache_dir=None,
                                                                          compiler="eager")),
                             ("breakable, compiler='inductor'", piecewise.CaptureConfig(
                                 max_tokens=64, cache_dir=None, frontend="breakable", compiler="inductor"))):
            started = time.perf_counter()
            runner = piecewise.compile(model, config)
            runner(eight, at[8])  # the first call is a prefill chunk: [1, 8] ids, the tokens in dimension 1
            torch.cuda.synchronize()
            runners[name] = (runner, time.perf_counter() - started)
        for tokens, ids in ((1, one), (8, eight)):
            want = model(ids, at[tokens])
            steps = {"eager": lambda ids=ids, pos=at[tokens]: model(ids, pos)}
            errors = {"eager": 0.0}
            for name, (runner, _) in runners.items():
                errors[name] = float((runner(ids, at[tokens]).float() - want.float()).abs().max())
                steps[name] = lambda runner=runner, ids=ids, pos=at[tokens]: runner(ids, pos)
            if tokens == 1:  # gpt-fast's own fast path: its decode step compiled whole, CUDA graph by torch
                compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
                for _ in range(3):
                    compiled(ids, at[tokens])
                errors["torch.compile reduce-overhead"] = float((compiled(ids, at[tokens]).float()
                                                                 - want.float()).abs().max())
                steps["torch.compile reduce-overhead"] = lambda ids=ids, pos=at[tokens]: compiled(ids, pos)
            ms = round_robin_ms(steps)
            rows += [(tokens, name, errors[name], ms[name]) for name in steps]
    lines = [f"# gpt-fast-shaped model called batch-first ({datetime.date.today()}, torch {torch.__version__}, "
             f"{torch.cuda.get_device_name()})", "",
             f"{LAYERS} layers, width {WIDTH}, {HEADS} heads, bf16, cache {MAX_SEQ} positions in buffers, ids [1, T].",
             "", "| tokens | runner | ms per call | max abs diff vs eager | first call s | token arguments |",
             "|---|---|---|---|---|---|"]
    for tokens, name, error, ms in rows:
        first = f"{runners[name][1]:.1f}" if name in runners else ""
        taken = str(runners[name][0].token_arguments) if name in runners else ""
        lines.append(f"| {tokens} | {name} | {ms:.3f} | {error:.3g} | {first} | {taken} |")
    for name, (runner, _) in runners.items():
        lines.append(f"\n{name}: frontend {runner.stats.frontend}, compiler {runner.config.compiler}, "
                     f"{runner.stats['frontend_reason'][:300]}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out_dir, "batch-first.md"), "w") as handle:
        handle.write(text + "\n")
    with open(os.path.join(out_dir, "batch-first.json"), "w") as handle:
        json.dump(rows, handle)


if __name__ == "__main__":
    main()
