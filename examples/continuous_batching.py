"""Greedy generation for many requests with continuous batching: a transformers model under piecewise, one
multi-sequence KV cache, each new request prefilled into a free slot, every running sequence decoded in one
flattened call per step, finished sequences' slots reused at once.

    python examples/continuous_batching.py                   # tiny random GLM-MoE on the CPU (no download)
    python examples/continuous_batching.py --device cuda --requests 64 --slots 32 --new-tokens 64

``generate`` is the whole scheduler (about thirty lines): the parts an engine adds (sampling, stop tokens,
paged memory, chunked prefill) go around the same two calls, ``runner(prompt, positions, cache, slots)`` and
``runner(last_tokens, positions, cache, slots)``. ``piecewise.generate`` is the ready-made loop with those parts
(prompts prefilled together in token-budgeted calls, sampling, stop tokens), paged memory aside.
"""

from __future__ import annotations

import argparse
import time
from collections import deque

import torch

import piecewise
from piecewise.integrations.transformers import TokenModel, enable

from glm_moe_transformers import model as tiny_glm_moe  # the example beside this one


def generate(runner, token_model: TokenModel, prompts: list[torch.Tensor], new_tokens: int, slots: int,
             max_seq_len: int) -> list[list[int]]:
    """Greedy continuations of ``new_tokens`` tokens for every prompt, at most ``slots`` sequences at a time."""
    device = prompts[0].device
    cache = token_model.make_kv_cache(max_seq_len, sequences=slots)
    free = list(range(slots))
    waiting = deque(enumerate(prompts))
    running: dict[int, tuple[int, list[int]]] = {}  # slot → (request, tokens generated so far)
    positions = torch.zeros(slots, dtype=torch.long, device=device)  # each slot's next position
    outputs: list[list[int]] = [[] for _ in prompts]
    while waiting or running:
        while waiting and free:  # admit: prefill a new request into a free slot
            request, prompt = waiting.popleft()
            if len(prompt) + new_tokens > max_seq_len:
                raise ValueError(f"request {request}: {len(prompt)} prompt + {new_tokens} new tokens > {max_seq_len}")
            slot = free.pop()
            logits = runner(prompt, torch.arange(len(prompt), device=device), cache,
                            torch.full((len(prompt),), slot, device=device))
            running[slot] = (request, [int(logits[-1].argmax())])
            positions[slot] = len(prompt)
        done = [slot for slot, (_, tokens) in running.items() if len(tokens) == new_tokens]
        for slot in done:  # finished: the slot is free for the next request
            request, tokens = running.pop(slot)
            outputs[request] = tokens
            free.append(slot)
        if not running:
            continue
        batch = torch.tensor(sorted(running), device=device)  # decode: one token of every running sequence
        last = torch.tensor([running[int(slot)][1][-1] for slot in batch], device=device)
        logits = runner(last, positions[batch], cache, batch)
        positions[batch] += 1
        for slot, token in zip(batch.tolist(), logits.argmax(-1).tolist()):
            running[slot][1].append(token)
    return outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = tiny_glm_moe(None, args.device, dtype)
    token_model = TokenModel(enable(model))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=max(args.slots, 16)))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (int(torch.randint(3, 20, (), generator=generator)),), generator=generator)
               .to(args.device) for _ in range(args.requests)]
    started = time.perf_counter()
    with torch.no_grad():
        outputs = generate(runner, token_model, prompts, args.new_tokens, args.slots, max_seq_len=64)
    seconds = time.perf_counter() - started
    for request, tokens in enumerate(outputs[:4]):
        print(f"request {request}: prompt {len(prompts[request])} tokens → {tokens}")
    stats = runner.stats
    print(f"{args.requests} requests, {args.requests * args.new_tokens} tokens in {seconds:.2f} s (first call "
          f"included); CUDA graphs: {'yes' if stats['cuda_graphs'] else 'no'}, replays {stats['replays']}, "
          f"padded calls {stats['padded_calls']}, calls above max_tokens {stats['fallback_calls']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
