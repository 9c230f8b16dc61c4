"""What the first call of ``F.scaled_dot_product_attention`` at a new shape costs, per backend, on CUDA.

    PYTHONPATH=src python benchmarks/sdpa_backends.py

torch orders cuDNN first on Hopper; cuDNN builds an execution plan for every new shape. Rows: the bundled L16
decode attention's shapes ([B, 4, 4, 128] queries over [B, 4, 1024, 128] keys) at half of vLLM's ladder per
backend (the first and second call at each new B, synchronised), then a causal prefill [1, 32, T, 64] and a masked
call [4, 8, T/4, 128] over T keys at 12 new lengths each, torch's default against ``kernels.attention.sdpa``
(cuDNN left out), and the host time of one decode-shaped call of each. Prints its rows.
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from piecewise.kernels.attention import sdpa

LADDER = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_shapes() -> None:
    cache = torch.randn(2, 512, 4, 1024, 128, device="cuda", dtype=torch.bfloat16)
    for label, backends, sizes in (("flash", [SDPBackend.FLASH_ATTENTION], LADDER[::2]),
                                   ("efficient", [SDPBackend.EFFICIENT_ATTENTION], LADDER[::2]),
                                   ("cudnn", [SDPBackend.CUDNN_ATTENTION], LADDER[::2]),
                                   ("default", None, LADDER[1::2])):
        first = second = 0.0
        for b in sizes:
            q = torch.randn(b, 4, 4, 128, device="cuda", dtype=torch.bfloat16)
            with sdpa_kernel(backends) if backends else torch.autograd.profiler.record_function("default"):
                first += _timed(lambda: F.scaled_dot_product_attention(q, cache[0, :b], cache[1, :b]))
                second += _timed(lambda: F.scaled_dot_product_attention(q, cache[0, :b], cache[1, :b]))
        print(f"decode shapes, {label}: {len(sizes)} new shapes, first calls {first * 1e3:.1f} ms in all, "
              f"second calls {second * 1e3:.1f} ms", flush=True)


def new_lengths() -> None:
    random.seed(0)
    lengths = random.sample(range(100, 4000), 24)

    def causal(t):
        x = torch.randn(1, 32, t, 64, device="cuda", dtype=torch.bfloat16)
        return (x, x, x), {"is_causal": True}

    def masked(t):
        q = torch.randn(4, 8, t // 4, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(4, 8, t, 128, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(4, 1, t // 4, t, device="cuda", dtype=torch.bool).tril(t - t // 4)
        return (q, k, k), {"attn_mask": mask}

    for label, make in (("causal prefill [1, 32, T, 64]", causal), ("masked [4, 8, T/4, 128]", masked)):
        ms = {}
        for name, fn, part in (("default", F.scaled_dot_product_attention, lengths[:12]),
                               ("sdpa()", sdpa, lengths[12:])):
            calls = [make(t) for t in part]
            ms[name] = sum(_timed(lambda a=a, k=k: fn(*a, **k)) for a, k in calls) / len(calls) * 1e3
        print(f"{label}: first call per new length, torch's default {ms['default']:.1f} ms, "
              f"sdpa() {ms['sdpa()']:.1f} ms", flush=True)


def host_time() -> None:
    q = torch.randn(8, 4, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, 4, 1024, 128, device="cuda", dtype=torch.bfloat16)
    for fn in (F.scaled_dot_product_attention, sdpa):
        fn(q, k, k)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(2000):
            fn(q, k, k)
        print(f"{fn.__name__}: {(time.perf_counter() - start) / 2000 * 1e6:.1f} us of host time a call (B=8 decode)")
        torch.cuda.synchronize()


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    decode_shapes()
    new_lengths()
    host_time()
