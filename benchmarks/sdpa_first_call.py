"""The first call of ``F.scaled_dot_product_attention`` at a new shape, per backend and grad mode, in the L16 decode
attention op (``piecewise.models.decode.decode_attention``: 16 query heads over 4 KV heads of a 1024-token cache).
cuDNN's backend builds an execution plan per shape on its first call; each CUDA-graph capture size is a new shape,
so whichever front-end captures first in a process pays it once per size.

    PYTHONPATH=src python benchmarks/sdpa_first_call.py
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from piecewise.models.decode import decode_attention

MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference": torch.inference_mode}


def call(cache: torch.Tensor, batch: int, grad: bool) -> tuple[float, float]:
    """ms of the first call at this batch, and of the next five (mean)."""
    q = torch.randn(batch, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    k = torch.randn(batch, 4, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, 4, 128, device="cuda", dtype=torch.bfloat16)
    positions = torch.full((batch,), 1023, device="cuda")
    torch.cuda.synchronize()
    started = time.perf_counter()
    decode_attention(q, k, v, positions, cache, 0)
    first = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(5):
        decode_attention(q, k, v, positions, cache, 0)
    steady = (time.perf_counter() - started) / 5
    torch.cuda.synchronize()
    return first * 1e3, steady * 1e3


def main() -> int:
    if not torch.cuda.is_available():
        print("sdpa_first_call.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    cache = torch.zeros(16, 2, 512, 4, 1024, 128, device="cuda", dtype=torch.bfloat16)
    offset = 0
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for mode, context in MODES.items():
            offset += 1  # batches no earlier case used: every first call is at a new shape
            with context():
                times = [call(cache, batch, mode == "grad") for batch in range(1 + offset, 500, 37)]
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    call(cache, 60 + offset, mode == "grad")
            kernels = sorted({e.name[:60] for e in prof.events() if e.device_type.name == "CUDA"
                              and any(k in e.name.lower() for k in ("sdpa", "flash", "fmha", "attn"))})
            firsts, later = [t[0] for t in times], [t[1] for t in times]
            print(f"cudnn_sdp={cudnn} {mode:9s} first call at a new shape: mean {sum(firsts) / len(firsts):.3f} ms, "
                  f"max {max(firsts):.3f} ms; later calls {sum(later) / len(later):.3f} ms; {kernels[:2]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
