"""Attention as a splitting op: writes the new keys/values into the KV cache, attends causally.

One sequence per call (``positions`` are the token positions within it). The op runs eagerly between
captured pieces and sees only the real tokens; on CUDA, up to 512 tokens attend in one Triton launch
(``kernels.attention``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..context import redirect_padding
from ..kernels.attention import KERNEL_TOKENS, attend
from ..opaque import opaque_op


def attention_fake(q, k, v, positions, kv_cache, layer, scale=None, window=0, softcap=0.0):
    """Output metadata of the attention ops: [T, Hq·D]."""
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def within_kernel(ctx) -> bool:
    """Capturable inside a full graph: the Triton kernel's calls (launch from shapes, metadata on the device)."""
    return ctx.padded_tokens <= KERNEL_TOKENS


@contextlib.contextmanager
def cache_overflow_named(positions: torch.Tensor, max_seq_len: int) -> Iterator[None]:
    """A write past the KV cache (an ``IndexError`` on CPU) named as the cache being too short for the positions.
    Free while they fit: the positions are read on the host only once the write has failed. On CUDA the write is a
    device-side assert instead, which no host code can catch."""
    try:
        yield
    except IndexError as exc:
        last = int(positions.max())
        if last < max_seq_len:
            raise
        raise ValueError(
            f"piecewise: position {last} is past the KV cache, whose max_seq_len is {max_seq_len} (positions 0 to "
            f"{max_seq_len - 1}): make a longer cache, make_kv_cache(max_seq_len={last + 1}) or more") from exc


@opaque_op("piecewise_examples::attention", fake=attention_fake, mutates_args=("kv_cache",), split=True,
           capturable=within_kernel)
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, layer: int,
    scale: float | None = None, window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [layers, 2, max_seq, Hkv, D] → [T, Hq·D]; ``scale`` defaults to
    1/√D; ``window`` (sliding window) and ``softcap`` as in ``kernels.attention.attend_over_cache``."""
    cache = kv_cache[layer]
    at, k_in, v_in = redirect_padding(positions, k, v)  # in a full graph: pad rows repeat the first row's write
    with cache_overflow_named(positions, cache.shape[1]):
        cache[0].index_copy_(0, at, k_in)
        cache[1].index_copy_(0, at, v_in)
    return attend(q, cache[0], cache[1], positions, scale, window=window, softcap=softcap).reshape(q.shape[0], -1)
