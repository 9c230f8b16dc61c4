"""Batched decode: B sequences, one new token each, a KV cache per sequence (the benchmark's "L16" shape)."""

from __future__ import annotations

import torch

from ..context import redirect_padding
from ..opaque import opaque_op
from ..kernels.attention import sdpa
from .attention import attention_fake, cache_overflow_named
from .llama import LlamaConfig, TinyLlama


@opaque_op("piecewise_examples::decode_attention", fake=attention_fake, mutates_args=("kv_cache",), split=True,
           capturable=True)
def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, layer: int
) -> torch.Tensor:
    """q [B, Hq, D], k/v [B, Hkv, D], kv_cache [layers, 2, Bmax, Hkv, S, D]; token b is sequence b at
    ``positions[b]``, attending to the whole cache row (the context is full: S tokens)."""
    batch, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if batch > kv_cache.shape[2]:
        raise ValueError(f"decode_attention: {batch} tokens but the KV cache holds {kv_cache.shape[2]} sequences; in a "
                         f"full graph the padded batch must fit too: CaptureConfig(max_decode_batch=...) at most that")
    cache = kv_cache[layer, :, :batch]  # [2, B, Hkv, S, D]
    rows, at, k_in, v_in = redirect_padding(torch.arange(batch, device=q.device), positions, k, v)
    with cache_overflow_named(positions, cache.shape[3]):
        cache[0][rows, :, at] = k_in
        cache[1][rows, :, at] = v_in
    # GQA without expanding K/V: the group's query heads become the query length of one KV head.
    query = q.view(batch, kv_heads, q_heads // kv_heads, head_dim)
    out = sdpa(query, cache[0], cache[1])
    return out.reshape(batch, q_heads * head_dim)


L16 = LlamaConfig(
    vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4, head_dim=128,
    intermediate_size=5632, max_seq_len=1024,
)


class DecodeLlama(TinyLlama):
    """``forward(input_ids [B], positions [B], kv_cache) -> logits [B, V]``: one decode step for B sequences."""

    def __init__(self, config: LlamaConfig = L16):
        super().__init__(config, attend=decode_attention)

    def make_kv_cache(self, batch: int, device=None, dtype=None, max_seq_len: int | None = None) -> torch.Tensor:
        """[layers, 2, batch, kv heads, max_seq_len (default: the config's), head dim]."""
        c = self.config
        weight = self.lm_head.weight
        return torch.zeros(
            (c.num_layers, 2, batch, c.num_kv_heads, max_seq_len or c.max_seq_len, c.head_dim),
            device=device or weight.device,
            dtype=dtype or weight.dtype,
        )
