"""What the first call of ``F.scaled_dot_product_attention`` at a new shape costs, per backend, on CUDA.

    PYTHONPATH=src python benchmarks/sdpa_backends.py [--mla]

torch orders cuDNN first on Hopper; cuDNN builds an execution plan for every new shape. Rows: the bundled L16
decode attention's shapes ([B, 4, 4, 128] queries over [B, 4, 1024, 128] keys) at half of vLLM's ladder per
backend (the first and second call at each new B, synchronised), then a causal prefill [1, 32, T, 64] and a masked
call [4, 8, T/4, 128] over T keys at 12 new lengths each, torch's default against ``kernels.attention.sdpa``
(cuDNN left out), and the host time of one decode-shaped call of each. ``--mla``: MLA's up-projected prefill
shapes instead (``mla_prefill``, ``mla_prompts``); ``--dsa``: DSA's attention over per-head picks (``dsa_picks``).
Prints its rows.
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from piecewise.kernels.attention import sdpa

STEADY = (1, 2, 3, 4, 6, 8, 12, 21)
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


def mla_prefill() -> None:
    """MLA's up-projected prefill (``integrations.mla``): queries and keys of 192 (128 + 64 rotary), values of 128,
    64 heads, causal: the first call at a new length and the steady time of each backend FlashAttention does not
    take (other widths), at lengths met in serving."""
    random.seed(1)
    lengths = random.sample(range(100, 4000), 8)

    def make(t):
        q = torch.randn(1, 64, t, 192, device="cuda", dtype=torch.bfloat16)
        return q, torch.randn_like(q), torch.randn(1, 64, t, 128, device="cuda", dtype=torch.bfloat16)

    for label, backends in (("default", None), ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
                            ("cudnn", [SDPBackend.CUDNN_ATTENTION])):
        with sdpa_kernel(backends) if backends else torch.autograd.profiler.record_function("default"):
            calls = [make(t) for t in lengths]
            first = sum(_timed(lambda a=a: F.scaled_dot_product_attention(*a, is_causal=True)) for a in calls)
            steady = []
            for t in (512, 2048, 8192):
                a = make(t)
                F.scaled_dot_product_attention(*a, is_causal=True)
                steady.append(min(_timed(lambda: F.scaled_dot_product_attention(*a, is_causal=True))
                                  for _ in range(10)) * 1e3)
        print(f"MLA prefill [1, 64, T, 192/128], {label}: first call per new length "
              f"{first / len(calls) * 1e3:.1f} ms; steady at T = 512 / 2048 / 8192: "
              + " / ".join(f"{ms:.3f}" for ms in steady) + " ms", flush=True)


def mla_prompts() -> None:
    """Prompts of 60 new lengths (1025-4000 tokens, one sequence from position 0) through MLA's up-projected prefill
    (``integrations.mla.up_projected_attention``: 64 heads, latent 512, rotary 64, values 128) with its lengths
    padded to ``plan_length`` (on Hopper by default) and without: the seconds the 60 first calls take, and the
    steady time of one call at 2000 tokens."""
    from piecewise.integrations import mla

    heads, nope, rope, latent, width = 64, 128, 64, 512, 128
    cache = torch.randn(1, 4096, latent + rope, device="cuda", dtype=torch.bfloat16)
    w_uk = torch.randn(heads, nope, latent, device="cuda", dtype=torch.bfloat16) / 20
    w_uv = torch.randn(heads, width, latent, device="cuda", dtype=torch.bfloat16) / 20
    random.seed(2)
    lengths = random.sample(range(1025, 4001), 120)
    original = mla.pads_for_plans

    def call(t):
        q_nope = torch.randn(t, heads, nope, device="cuda", dtype=torch.bfloat16)
        q_rope = torch.randn(t, heads, rope, device="cuda", dtype=torch.bfloat16)
        rows = torch.zeros(t, dtype=torch.long, device="cuda")
        return lambda: mla.up_projected_attention(q_nope, q_rope, cache, rows, torch.arange(t, device="cuda"), 0.1,
                                                  w_uk, w_uv)

    for label, pads, part in (("padded to plan_length", original, lengths[:60]),
                              ("unpadded", lambda tensor: False, lengths[60:])):
        mla.pads_for_plans = pads
        try:
            first = sum(_timed(call(t)) for t in part)
            fn = call(2000)
            fn()
            steady = min(_timed(fn) for _ in range(10)) * 1e3
        finally:
            mla.pads_for_plans = original
        print(f"MLA up-projected prefill, {label}: 60 new prompt lengths {first:.2f} s in all; one call at 2000 "
              f"tokens {steady:.3f} ms", flush=True)


def dsa_picks() -> None:
    """DSA's attention over per-head keys (``integrations.dsa.dsa_attention``, the cache without latent rows): per
    token one query row per head over its 2048 picked keys, GLM-5's 64 heads of 192, a mask [t, 1, 1, 2048]; its
    chunks hold at most 21 tokens at these shapes (``dsa._chunks``). The first call at each chunk height 1-21, and
    the steady time at 1, 8 and 21 tokens, torch's default against ``kernels.attention.sdpa`` (cuDNN left out)."""
    heads, width, picks = 64, 192, 2048

    def make(t):
        q = torch.randn(t, heads, 1, width, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(t, heads, picks, width, device="cuda", dtype=torch.bfloat16)
        visible = torch.rand(t, 1, 1, picks, device="cuda") < 0.9
        return q, k, k, visible

    for label, fn, heights in (("default", F.scaled_dot_product_attention, range(1, 22, 2)),
                               ("sdpa (no cuDNN)", sdpa, range(2, 22, 2))):
        first = [_timed(lambda a=make(t): fn(a[0], a[1], a[2], attn_mask=a[3], scale=0.1)) for t in heights]
        steady = []
        for t in STEADY:
            a = make(t)
            fn(a[0], a[1], a[2], attn_mask=a[3], scale=0.1)
            steady.append(min(_timed(lambda: fn(a[0], a[1], a[2], attn_mask=a[3], scale=0.1))
                              for _ in range(10)) * 1e3)
        print(f"DSA picks [t, 64, 1, 192] over [t, 64, 2048, 192], {label}: first call per new height "
              f"{sum(first) / len(first) * 1e3:.1f} ms (max {max(first) * 1e3:.1f}); steady at t = " + " / ".join(map(str, STEADY)) + ": "
              + " / ".join(f"{ms:.3f}" for ms in steady) + " ms", flush=True)


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
    import sys

    print(torch.__version__, torch.cuda.get_device_name())
    if "--dsa" in sys.argv:
        dsa_picks()
        sys.exit()
    if "--mla" in sys.argv:
        mla_prefill()
        mla_prompts()
        sys.exit()
    decode_shapes()
    new_lengths()
    host_time()
