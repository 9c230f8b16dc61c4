"""The case piecewise's breakable front-end exists for: a JIT kernel library's first-use check (a subprocess under
a lock) inside a decoder layer whose attention op writes a KV cache. Dynamo cannot trace it; ``frontend="auto"``
runs the model breakable, and ``piecewise verify`` checks every size against eager.

    piecewise doctor examples/jit_in_layer.py:example    # Dynamo blocked; breakable usable (exit 1)
    piecewise run examples/jit_in_layer.py:example       # auto -> breakable, matches eager
    piecewise verify examples/jit_in_layer.py:example    # every captured size against eager
"""

from __future__ import annotations

import functools
import subprocess
import sys
import threading

import torch

from piecewise.models import llama

_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def toolkit_version() -> str:
    """What JIT kernel libraries do on first use: run the toolkit and parse its banner."""
    return subprocess.check_output([sys.executable, "-c", "print('release 12.8')"], text=True).strip()


class CheckedNorm(llama.RMSNorm):
    """RMSNorm whose "kernel" first checks the toolkit version under a lock, as a JIT library would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _lock:
            toolkit_version()
        return super().forward(x)


def example(tokens: int = 7, device: str = "cpu"):
    """``(model, (input_ids, positions, kv_cache))``: the bundled tiny Llama with a checked norm in every layer."""
    model, inputs = llama.example(tokens=tokens, device=device)
    for layer in model.layers:
        norm = CheckedNorm(model.config.hidden_size).to(device)
        norm.load_state_dict(layer.input_norm.state_dict())
        layer.input_norm = norm
    return model, inputs


def example_inputs(num_tokens: int):
    """Other inputs of ``num_tokens`` tokens for ``piecewise verify`` (a prompt starting at position 2); verify
    uses the captured KV cache in place of the one given here."""
    input_ids = torch.randint(0, llama.LlamaConfig.vocab_size, (num_tokens,))
    return input_ids, torch.arange(num_tokens) + 2, None
