"""Attention as a splitting op: writes the new keys/values into the KV cache, attends causally.

One sequence per call (``positions`` are the token positions within it). The op runs eagerly between
captured pieces and sees only the real tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..opaque import opaque_op


def attention_fake(q, k, v, positions, kv_cache, layer, scale=None):
    """Output metadata of the attention ops: [T, Hq·D]."""
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@opaque_op("piecewise_examples::attention", fake=attention_fake, mutates_args=("kv_cache",), split=True)
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, layer: int,
    scale: float | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [layers, 2, max_seq, Hkv, D] → [T, Hq·D]; ``scale`` defaults to
    1/√D."""
    cache = kv_cache[layer]
    cache[0].index_copy_(0, positions, k)
    cache[1].index_copy_(0, positions, v)
    return attend_over_cache(q, cache[0], cache[1], positions, scale)


def attend_over_cache(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """q [T, Hq, D] of one sequence at ``positions`` attends causally over its cache [S, Hkv, D] → [T, Hq·D]."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = cache_k.shape[1]
    keys = cache_k.transpose(0, 1)  # [Hkv, S, D]
    values = cache_v.transpose(0, 1)
    group = q_heads // kv_heads
    # [Hkv, group·T, D]: the query heads of one KV head attend to it together (no K/V expansion).
    query = q.view(tokens, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, group * tokens, head_dim)
    key_positions = torch.arange(cache_k.shape[0], device=q.device)
    visible = key_positions[None, :] <= positions[:, None]  # [T, S] causal over the cache
    mask = visible.repeat(group, 1)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    return out.view(kv_heads, group, tokens, head_dim).permute(2, 0, 1, 3).reshape(tokens, q_heads * head_dim)
