"""Multi-head latent attention (MLA: DeepSeek-V3, DeepSeek-V3.2, GLM-5, ...) over a latent KV cache, for
``integrations.transformers``.

MLA compresses each token's keys and values into one row: the normalised ``kv_lora_rank`` latent ``c`` and the
rotated ``qk_rope_head_dim`` key ``k_pe``, shared by every head; ``kv_b_proj`` expands ``c`` into each head's
keys (``W_UK``) and values (``W_UV``). The cache holds that row only: ``kv_lora_rank + qk_rope_head_dim``
values per token and layer (576 for DeepSeek-V3 and GLM-5, against 2 · heads · head width per head). Attention
runs in the latent space by weight absorption: the query's no-rope part is multiplied by ``W_UK`` (scores
``q·W_UK·c + q_pe·k_pe``), the attention's output (a mix of latent rows) by ``W_UV``. ``mla_attention`` (a
capturable splitting op) writes the call's rows into the cache and attends over them (``kernels.mla``): over every
earlier position, or, for DeepSeek sparse attention (``integrations.dsa``), over the top-k keys the indexer picked
for each query. A long dense call (prefill) up-projects the rows instead (``UP_PROJECT_TOKENS``).

The attention module's ``forward`` is replaced by ``latent_forward`` for the classes in ``LATENT_CLASSES``,
whose forward it reproduces (tested against transformers' for each); it takes the latent path when
``TokenModel`` passes a latent cache, and runs the class's own forward otherwise (no cache, or the model called
the transformers way).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..context import redirect_padding
from ..kernels import latent_fp8
from ..models.attention import cache_overflow_named
from ..opaque import opaque_op
from ..stored import stored_as
from .dsa import ATTENTION

LATENT_CLASSES = frozenset({"DeepseekV3Attention", "DeepseekV32Attention", "GlmMoeDsaAttention",
                            "Glm4MoeLiteAttention", "Mistral4Attention", "YoutuAttention",
                            "MiniCPM3Attention"})
"""Attention classes whose forward ``latent_forward`` reproduces: q through ``q_a_proj`` / ``q_a_layernorm`` /
``q_b_proj`` (or ``q_proj``), the latent through ``kv_a_proj_with_mqa`` / ``kv_a_layernorm``, keys and values
through ``kv_b_proj``, rotary by the module's ``apply_rotary_pos_emb(_interleave)``, ``o_proj``, ``scaling``."""


def is_mla(config) -> bool:
    return bool(getattr(config, "kv_lora_rank", None))


def uses_latent_cache(model: nn.Module) -> bool:
    """True where ``enable`` gave every MLA attention module of ``model`` the latent path."""
    return bool(getattr(model, "_piecewise_latent", False))


def latent_width(config) -> int:
    return config.kv_lora_rank + config.qk_rope_head_dim


UP_PROJECT_TOKENS = 1024
"""Dense MLA calls of more tokens than this (prefill, long extend) attend by up-projecting the gathered latent rows
into per-head keys and values (one SDPA per sequence) instead of in the latent space: per query and head the
absorbed scores cost kv_lora_rank + qk_rope_head_dim and the sum kv_lora_rank multiply-adds per key (1088 for
DeepSeek-V3), against qk_nope + qk_rope + v_head_dim (320) once up-projected, which a long prefill's keys pay back
(``benchmarks/mla_decode.py``, RESULTS.md). Sparse attention (DSA) attends in the latent space (each query has its
own picks, so no up-projection is shared), except where no query of a long call has more earlier keys than it
picks: it then picks every one, and the dense path is the same attention."""


def _fake(q_nope, q_rope, latent, k_rope, positions, slots, cache, layer, scale, indices, kv_b_weight):
    heads = q_nope.shape[1]
    return q_nope.new_empty(q_nope.shape[0], heads, kv_b_weight.shape[0] // heads - q_nope.shape[2])


def _capturable(ctx) -> bool:
    """Within a full graph: calls of up to ``UP_PROJECT_TOKENS`` (the latent kernel, no host sync)."""
    return ctx.padded_tokens <= UP_PROJECT_TOKENS


@opaque_op("piecewise_hf::mla_attention", fake=_fake, mutates_args=("cache",), split=True, capturable=_capturable)
def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor | None, cache: torch.Tensor, layer: int, scale: float,
                  indices: torch.Tensor | None, kv_b_weight: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope], q_rope [T, H, P] (rotated), the call's latent rows [T, R] and rotated keys [T, P],
    ``kv_b_proj``'s weight [H · (nope + v), R] → [T, H, v]. The rows are written into ``cache[layer]`` at
    ``positions`` (of sequence ``slots[t]``; cache [layers, (sequences,) max_seq, R + P]), then each query attends
    over its sequence's rows at or before its position, all of them (``indices`` None) or its picks [T, K]: in
    the latent space (q_nope · W_UK as the query, the output through W_UV), or, for a long dense call, over keys
    and values up-projected from the rows (``UP_PROJECT_TOKENS``). Capturable up to ``UP_PROJECT_TOKENS``: in a
    full-graph call the pad rows write and read what the first row does."""
    from ..kernels.mla import attend_latent

    tokens, heads, nope = q_nope.shape
    w = kv_b_weight.view(heads, -1, kv_b_weight.shape[1]).to(q_nope.dtype)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, nope, R], [H, v, R]
    layer_cache = cache[layer] if slots is not None else cache[layer].unsqueeze(0)  # [sequences, max_seq, R + P]
    rows = slots if slots is not None else torch.zeros_like(positions)
    rows, positions, latent, k_rope, q_nope, q_rope = redirect_padding(rows, positions, latent, k_rope, q_nope, q_rope)
    with cache_overflow_named(positions, layer_cache.shape[1]):
        layer_cache[rows, positions] = latent_fp8.quantize_rows(latent, k_rope) if is_fp8_cache(layer_cache) else \
            torch.cat([latent, k_rope], dim=-1).to(layer_cache.dtype)
    if tokens > UP_PROJECT_TOKENS and (indices is None or int(positions.max()) < indices.shape[1]):
        # dense, or sparse where no query has more earlier keys than picks: each query then picks them all
        return up_projected_attention(q_nope, q_rope, layer_cache, rows, positions, scale, w_uk, w_uv)
    if indices is not None:
        indices = redirect_padding(indices)[0]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, R]
    out = attend_latent(q_latent, q_rope, layer_cache, rows, positions, scale, indices)
    return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).contiguous()  # [T, H, v], as _fake


QUERY_CHUNK = 4096
"""Queries per SDPA call of ``up_projected_attention`` (bounds its mask and its workspace)."""


def up_projected_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, layer_cache: torch.Tensor, rows: torch.Tensor,
                           positions: torch.Tensor, scale: float, w_uk: torch.Tensor,
                           w_uv: torch.Tensor) -> torch.Tensor:
    """Dense MLA by up-projection, one sequence of the call at a time: the sequence's rows 0 .. its last position
    become per-head keys (``W_UK · c`` beside the shared rotated key) and values (``W_UV · c``), and SDPA attends
    causally (by position) → [T, H, v]. Reads the positions on the host: eager calls only."""
    tokens, heads, nope = q_nope.shape
    latent = w_uk.shape[2]
    out = q_nope.new_empty(tokens, heads, w_uv.shape[1])
    pads = pads_for_plans(q_nope)
    for slot in torch.unique(rows).tolist():
        index = (rows == slot).nonzero().squeeze(1)
        at = positions[index]
        length = int(at.max()) + 1
        kept = layer_cache[slot, :length]
        kept = latent_fp8.dequantize_rows(kept, latent, q_nope.dtype) if is_fp8_cache(kept) else kept.to(q_nope.dtype)
        padded = plan_length(length) if pads else length
        if padded > length:
            kept = F.pad(kept, (0, 0, 0, padded - length))  # zero rows past the sequence: keys no query sees
        keys = torch.cat([torch.einsum("sr,hnr->hsn", kept[:, :latent], w_uk),
                          kept[None, :, latent:].expand(heads, -1, -1)], dim=-1)  # [H, S, nope + P]
        values = torch.einsum("sr,hvr->hsv", kept[:, :latent], w_uv)  # [H, S, v]
        query = torch.cat([q_nope[index], q_rope[index]], dim=-1).transpose(0, 1)  # [H, t, nope + P]
        from_start = index.numel() == length and bool((at == torch.arange(length, device=at.device)).all())
        keys, values = keys[None], values[None]  # 4-D: SDPA's fused kernels take nothing else
        for start in range(0, index.numel(), QUERY_CHUNK):
            stop = min(start + QUERY_CHUNK, index.numel())
            causal = from_start and start == 0 and stop == length  # the whole sequence from position 0
            count = stop - start
            height = (padded if causal else plan_length(count)) if pads else count
            chunk, seen = query[:, start:stop], at[start:stop]
            if height > count:  # zero queries, dropped after; a padded row sees key 0 alone (none sees no key)
                chunk, seen = F.pad(chunk, (0, 0, 0, height - count)), F.pad(seen, (0, height - count))
            if causal:
                part = F.scaled_dot_product_attention(chunk[None], keys, values, is_causal=True, scale=scale)
            else:
                visible = torch.arange(padded, device=at.device)[None, :] <= seen[:, None]
                part = F.scaled_dot_product_attention(chunk[None], keys, values, attn_mask=visible, scale=scale)
            out[index[start:stop]] = part[0, :, :count].transpose(0, 1)
    return out


def plan_length(n: int) -> int:
    """``n`` rounded up to one of 16 lengths per octave (at most 1/16 more, in steps of 64 at least): the lengths
    SDPA sees in ``up_projected_attention`` where ``pads_for_plans``."""
    step = max(64, 1 << max(n.bit_length() - 5, 0))
    return -(-n // step) * step


def pads_for_plans(tensor: torch.Tensor) -> bool:
    """Whether up-projected prefills pad their lengths (``plan_length``): where torch sends SDPA to cuDNN first
    (Hopper and later, cuDNN's backend on), which builds an execution plan at every new shape, 186 ms each for
    MLA's prefill shapes on an H200 against 0.2-2.2 ms for the call itself, so that each new prompt length paid
    it once (benchmarks/RESULTS.md, "MLA's prefill and cuDNN's plans"). FlashAttention does not take MLA's widths
    (keys of 192, values of 128) and memory-efficient attention is 3-4x slower there, so cuDNN stays, over fewer
    shapes: at most 1/16 more rows, masked or causal as before."""
    return tensor.is_cuda and torch.backends.cuda.cudnn_sdp_enabled() and \
        torch.cuda.get_device_capability(tensor.device)[0] >= 9


def _rotary(module: nn.Module):
    """The rotary function the class's forward applies to (q_rot, k_rot): interleaved or not, as it decides."""
    modeling = sys.modules[type(module).__module__]
    source = inspect.getsource(type(module).forward)
    interleaved = getattr(modeling, "apply_rotary_pos_emb_interleave", None)
    if "rope_interleave" in source:
        return interleaved if module.config.rope_interleave else modeling.apply_rotary_pos_emb
    if "apply_rotary_pos_emb_interleave" in source:
        return interleaved
    return modeling.apply_rotary_pos_emb


def latent_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
    """The module's attention over the latent cache that ``TokenModel`` passes (see the module docstring); the
    class's own forward without one, or with the model's own attention put back."""
    call = self._piecewise_call
    cache = call.get("piecewise_kv_cache")
    if cache is None or self.config._attn_implementation != ATTENTION:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    batch, tokens, _ = hidden_states.shape
    nope, rope = self.qk_nope_head_dim, self.qk_rope_head_dim
    if getattr(self, "q_a_proj", None) is not None:
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q = self.q_b_proj(q_resid)
    else:
        q_resid, q = None, self.q_proj(hidden_states)
    q = q.view(batch, tokens, -1, nope + rope).transpose(1, 2)  # [1, H, T, nope + rope]
    q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
    latent, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, rope], dim=-1)
    latent = self.kv_a_layernorm(latent)
    cos, sin = position_embeddings
    q_rot, k_rot = self._piecewise_rotary(q_rot, k_rot.view(batch, 1, tokens, rope), cos, sin)
    topk = None
    indexer = getattr(self, "indexer", None)
    if indexer is not None:
        topk = indexer(hidden_states, q_resid, position_embeddings, None, kwargs.get("position_ids"))
    elif "prev_topk_indices" in kwargs:  # a layer sharing the previous indexer's picks (GLM-5 after 5.20)
        topk = kwargs["prev_topk_indices"]
    out = mla_attention(q_nope[0].transpose(0, 1), q_rot[0].transpose(0, 1), latent[0], k_rot[0, 0],
                        call["piecewise_positions"], call.get("piecewise_slots"), cache, self.layer_idx,
                        self.scaling, None if topk is None else topk[0], self.kv_b_proj.weight)  # [T, H, v]
    out = self.o_proj(out.reshape(batch, tokens, -1))
    return (out, None, topk) if self._piecewise_returns_topk else (out, None)


def enable_latent(model: nn.Module, on: bool = True) -> bool:
    """Give every MLA attention module of ``model`` the latent path, where all of them are of a class in
    ``LATENT_CLASSES`` (otherwise none: the per-head cache serves the model); ``on=False`` takes it away again.
    Returns whether the model now uses the latent cache."""
    attention = [m for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "kv_a_proj_with_mqa")]
    supported = is_mla(model.config) and attention and all(type(m).__name__ in LATENT_CLASSES for m in attention)
    for module in attention:
        if on and supported:
            if getattr(module.__dict__.get("forward"), "__func__", None) is latent_forward:
                continue  # enable() again (after set_attn_implementation): a new method would read as a change
            module.forward = types.MethodType(latent_forward, module)
            module._piecewise_rotary = _rotary(module)
            module._piecewise_returns_topk = "prev_topk_indices" in inspect.signature(type(module).forward).parameters
        else:
            module.__dict__.pop("forward", None)  # the class's own
    model._piecewise_latent = bool(on and supported)
    return model._piecewise_latent


def is_fp8_cache(cache: torch.Tensor) -> bool:
    """A latent cache of FP8 rows (``kernels.latent_fp8``): bytes."""
    return cache.dtype == torch.uint8


def row_width(config, dtype) -> int:
    """The last dimension of a latent cache of ``dtype``: values, or an FP8 row's bytes."""
    if latent_fp8.is_fp8_dtype(dtype):
        return latent_fp8.row_bytes(config.kv_lora_rank, config.qk_rope_head_dim)
    return latent_width(config)


def row_bytes(config, dtype) -> int:
    """Bytes of one token's row in one layer of a latent cache of ``dtype``."""
    return row_width(config, dtype) * (1 if latent_fp8.is_fp8_dtype(dtype) else dtype.itemsize)


def make_latent_cache(model: nn.Module, max_seq_len: int, sequences: int | None, device, dtype) -> torch.Tensor:
    """[layers, (sequences,) max_seq_len, kv_lora_rank + qk_rope_head_dim], zeroed; for an FP8 ``dtype``
    (``torch.float8_e4m3fn`` or ``"fp8"``) uint8 rows of ``kernels.latent_fp8``'s layout, [..., 656] for
    DeepSeek-V3 and GLM-5."""
    c = model.config
    width = row_width(c, dtype)
    shape = (max_seq_len, width) if sequences is None else (sequences, max_seq_len, width)
    if not latent_fp8.is_fp8_dtype(dtype):
        return torch.zeros(c.num_hidden_layers, *shape, device=device, dtype=dtype)
    cache = torch.zeros(c.num_hidden_layers, *shape, device=device, dtype=torch.uint8)
    return stored_as(cache, functools.partial(latent_fp8.dequantize_rows, latent=c.kv_lora_rank, dtype=torch.bfloat16))
