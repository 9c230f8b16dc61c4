"""DeepSeek sparse attention ("indexed attention": GLM-5's ``glm_moe_dsa``, DeepSeek-V3.2's ``deepseek_v32``) for
``integrations.transformers``.

A lightning indexer scores every cached key for each query, keeps the top-k, and attention (MLA) runs over those
keys only. Under piecewise both halves are splitting ops on the real rows: ``dsa_select`` writes the call's
indexer keys into an indexer key cache beside the MLA cache and picks each query's top-k among the keys at or
before its position; ``dsa_attention`` writes the call's keys and values into the KV cache and attends over the
selected ones. The projections (and their rotary embedding, interleaved in GLM-5) stay in the model's code, in
the pieces. Top-k and gather run on the device: no host sync, so both ops are capturable and a GLM-5 decode step
runs as one full graph (``CaptureConfig.graph_mode``) where its experts are captured too. Without a KV cache the
call's own tokens are the keys.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..context import context, redirect_padding
from ..models.attention import cache_overflow_named
from ..kernels import indexer as indexer_kernel
from ..kernels.attention import sdpa
from ..kernels.indexer import index_scores, index_scores_reference
from ..opaque import opaque_op

INDEXED = frozenset({"indexed_attention", "deepseek_sparse_attention"})
"""The layer type's name: ``deepseek_sparse_attention`` up to transformers 5.17, ``indexed_attention`` after."""


ATTENTION = "piecewise"
"""The attention implementation's name in transformers' registry (``integrations.transformers.NAME``)."""


def is_indexed(config) -> bool:
    return bool(INDEXED & set(getattr(config, "layer_types", None) or ()))


def _select_fake(q, k, weights, positions, slots, index_cache, topk, scale):
    return q.new_empty(q.shape[0], topk, dtype=torch.long)


def _call_keys(positions: torch.Tensor) -> torch.Tensor:
    """The positions of a call's own tokens as keys (no cache): a full-graph call's pad rows never are keys."""
    ctx = context()
    mask = ctx.token_mask if ctx is not None else None
    return positions if mask is None else torch.where(mask, positions, torch.iinfo(positions.dtype).max)


@opaque_op("piecewise_hf::dsa_select", fake=_select_fake, mutates_args=("index_cache",), split=True,
           capturable=True)
def dsa_select(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor | None, index_cache: torch.Tensor | None, topk: int, scale: float) -> torch.Tensor:
    """q [T, H, D], k [T, D], weights [T, H] (the indexer's per-head weights, already scaled) → [T, topk] key
    indices: the cache positions (or, without a cache, the call's token indices) of the top-k keys by
    Σ_h weights·relu(q·k)·scale among the keys at or before each query's position. Picks past the valid keys
    point at keys the attention masks out, as transformers' own selection does.

    Capturable (no host sync): in a full-graph call the pad rows write and read what the first row does."""
    if index_cache is not None:
        cache = index_cache if slots is not None else index_cache.unsqueeze(0)  # [sequences, max_seq, D]
        rows = slots if slots is not None else torch.zeros_like(positions)
        rows, positions, k = redirect_padding(rows, positions, k)
        with cache_overflow_named(positions, cache.shape[1]):
            cache[rows, positions] = k.to(cache.dtype)
        key_positions = torch.arange(cache.shape[1], device=q.device)
    else:
        key_positions = _call_keys(positions)
    picks = []
    for start, stop in _chunks(q.shape[0], key_positions.shape[0] * max(q.shape[1:])):  # bounded memory, long calls
        if index_cache is not None:  # each token's own sequence's keys
            scores_of = index_scores if q.is_cuda and indexer_kernel.triton is not None else index_scores_reference
            index = scores_of(q[start:stop], weights[start:stop], cache, rows[start:stop], positions[start:stop],
                              scale)
        else:  # the call's keys, shared by its tokens
            scores = F.relu(torch.einsum("thd,jd->thj", q[start:stop].float(), k.float())) * scale
            index = torch.einsum("th,thj->tj", weights[start:stop].float(), scores)
            index = index.masked_fill(key_positions[None, :] > positions[start:stop, None], float("-inf"))
        if index.shape[1] < topk:  # fewer keys than picks (no cache): the rest point past them, masked
            index = F.pad(index, (0, topk - index.shape[1]), value=float("-inf"))
        picks.append(index.topk(topk, dim=-1).indices)
    return torch.cat(picks) if len(picks) > 1 else picks[0]


def _chunks(tokens: int, per_token: int, budget: int = 1 << 29) -> list[tuple[int, int]]:
    """Token ranges of at most ``budget`` elements of ``per_token`` each (at least one token): a long prefill's
    gathered keys are bounded by a few GB (GLM-5: 2048 picks of 64 heads × 256 per token, 16 tokens a run; the
    selection's float copies and scores come on top)."""
    step = max(1, budget // max(per_token, 1))
    return [(start, min(start + step, tokens)) for start in range(0, tokens, step)]


def _attention_fake(q, k, v, positions, slots, kv_cache, layer, scale, indices):
    return q.new_empty(q.shape)


@opaque_op("piecewise_hf::dsa_attention", fake=_attention_fake, mutates_args=("kv_cache",), split=True,
           capturable=True)
def dsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor | None, kv_cache: torch.Tensor | None, layer: int, scale: float,
                  indices: torch.Tensor) -> torch.Tensor:
    """q / k / v [T, H, W] (MLA, one width), ``indices`` [T, K] from ``dsa_select`` → [T, H, W]: each query
    attends over its selected keys at or before its position. With ``kv_cache`` the call's keys and values are
    written at ``positions`` first (of sequence ``slots[t]`` where given). Capturable, as ``dsa_select``."""
    if kv_cache is not None:
        cache = kv_cache[layer] if slots is not None else kv_cache[layer].unsqueeze(1)  # [2, seq, max_seq, H, W]
        rows = slots if slots is not None else torch.zeros_like(positions)
        rows, positions, k, v = redirect_padding(rows, positions, k, v)
        cache[0][rows, positions] = k
        cache[1][rows, positions] = v
        picked = indices.clamp(max=cache.shape[2] - 1)
        key_positions = indices
    else:
        picked = indices.clamp(max=k.shape[0] - 1)
        key_positions = torch.where(indices < k.shape[0], _call_keys(positions)[picked],
                                    torch.iinfo(positions.dtype).max)
    out = []
    for start, stop in _chunks(q.shape[0], indices.shape[1] * q.shape[1] * q.shape[2]):  # bounded memory
        if kv_cache is not None:
            chunk_rows, chunk_picked = rows[start:stop, None], picked[start:stop]
            keys, values = cache[0][chunk_rows, chunk_picked], cache[1][chunk_rows, chunk_picked]  # [t, K, H, W]
        else:
            keys, values = k[picked[start:stop]], v[picked[start:stop]]
        visible = (key_positions[start:stop] <= positions[start:stop, None])[:, None, None, :]  # [t, 1, 1, K]
        attend = F.scaled_dot_product_attention if stop - start <= CUDNN_TOKENS else sdpa
        out.append(attend(  # per token: one query row per head over its K picks
            q[start:stop, :, None], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=visible,
            scale=scale)[:, :, 0])
    return (torch.cat(out) if len(out) > 1 else out[0]).to(q.dtype)


CUDNN_TOKENS = 2
"""Chunks of at most this many tokens keep torch's SDPA order (cuDNN first on Hopper), taller ones leave cuDNN out
(``kernels.attention.sdpa``). cuDNN builds a plan at each new height (65-210 ms on an H200, against 1 ms), and at
GLM-5's shapes is faster at 1-2 tokens (0.10 against 0.18 ms), within 7% at 3-4 and slower from 6 (8: 0.33
against 0.29 ms): two plans, not one per height (``benchmarks/sdpa_backends.py --dsa``)."""


def indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None,
                    past_key_values=None):
    """The model's indexer with its top-k selection in ``dsa_select`` (its projections and rotary as written).

    With the model's own attention put back (``config._attn_implementation`` not piecewise's), the model's own
    indexer runs: its selection goes with its own attention, mask and cache, as transformers computes them."""
    if self._piecewise_config._attn_implementation != ATTENTION:
        given = {name: value for name, value in (("cache", cache), ("past_key_values", past_key_values))
                 if value is not None}  # transformers 5.24 names it cache, 5.17 past_key_values
        return type(self).forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                                  **given)
    modeling = sys.modules[type(self).__module__]
    rotate = getattr(modeling, "apply_rotary_pos_emb_interleave") if "GlmMoeDsa" in type(self).__name__ else \
        getattr(modeling, "apply_rotary_pos_emb")
    batch, tokens, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(batch, tokens, self.n_heads, self.head_dim)
    q_rot, q_pass = torch.split(q, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)[0]  # [T, H, D]
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)[0]  # [T, D]
    weight = getattr(self.weights_proj, "weight", None)  # an NVFP4 layer's is packed codes: keep the model's dtype
    dtype = weight.dtype if weight is not None and weight.is_floating_point() else hidden_states.dtype
    weights = self.weights_proj(hidden_states.to(dtype)).float()[0] * (self.n_heads ** -0.5)
    call = self._piecewise_call
    positions = call.get("piecewise_positions")
    if positions is None:
        positions = position_ids[0] if position_ids is not None else torch.arange(tokens, device=q.device)
    index_cache = getattr(self, "piecewise_index_cache", None) if call.get("piecewise_kv_cache") is not None else None
    if call.get("piecewise_kv_cache") is not None and index_cache is None:
        raise ValueError("the indexer key cache is missing: make the KV cache with TokenModel(model).make_kv_cache, "
                         "which makes it too, before the first call")
    topk = self.index_topk if index_cache is None else min(self.index_topk, index_cache.shape[-2])
    return dsa_select(q, k, weights, positions, call.get("piecewise_slots"), index_cache, topk,
                      self.softmax_scale)[None]


def enable_indexed(model: nn.Module, shared: dict) -> None:
    """Route every DSA indexer of ``model`` through ``dsa_select`` (the attention goes through ``dsa_attention``,
    see ``integrations.transformers.attention_forward``)."""
    for module in indexers(model):
        module.forward = types.MethodType(indexer_forward, module)
        module._piecewise_call = shared
        module._piecewise_config = model.config


def indexers(model: nn.Module) -> list[nn.Module]:
    """The model's DSA indexers (``weights_proj`` beside the query and key projections)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Indexer") and hasattr(m, "weights_proj")]


def make_index_caches(model: nn.Module, max_seq_len: int, sequences: int | None, device, dtype) -> None:
    """The indexer key caches beside the KV cache: one buffer per indexer, [(sequences,) max_seq_len, D]."""
    for module in indexers(model):
        shape = (max_seq_len, module.head_dim) if sequences is None else (sequences, max_seq_len, module.head_dim)
        module.register_buffer("piecewise_index_cache", torch.zeros(shape, device=device, dtype=dtype),
                               persistent=False)


def dummy_mask(kwargs: dict) -> torch.Tensor:
    """What the mask interface gives an indexed-attention model: its attention indexes the mask
    (``attention_mask[:, 0]``) before the piecewise ops, which mask by position themselves."""
    like = kwargs.get("inputs_embeds", kwargs.get("input_embeds"))
    return torch.zeros(1, 1, 1, 1, device=getattr(like, "device", None), dtype=getattr(like, "dtype", None))
