"""The KV cache layouts of ``TokenModel``: per-head keys and values, or MLA's latent rows (``integrations.mla``),
and the DSA indexers' key caches beside them (``integrations.dsa``)."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import latent_fp8
from . import dsa, mla


def check_cache(model: nn.Module, kv_cache: torch.Tensor, slots: torch.Tensor | None) -> None:
    """Refuse a cache of another layout than ``make`` makes (a latent cache given to a per-head model or the
    reverse; one sequence's cache with ``slots``, or the reverse)."""
    latent = mla.uses_latent_cache(model)
    want = (3 if latent else 5) + (slots is not None)
    fp8 = latent and kv_cache.dtype == torch.uint8  # FP8 rows (kernels.latent_fp8)
    if not (kv_cache.dtype.is_floating_point or fp8):
        raise ValueError(f"kv_cache has dtype {kv_cache.dtype}; make it with TokenModel(model).make_kv_cache, in the "
                         f"model's floating dtype" + (" or dtype='fp8' (a latent cache of FP8 rows)" if latent else ""))
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None  # (NVFP4 layers
    weight = (embeddings.weight if hasattr(embeddings, "weight") else next(model.parameters())).dtype  # hold codes)
    if not fp8 and kv_cache.dtype != weight and not torch.is_autocast_enabled(kv_cache.device.type):
        raise ValueError(f"kv_cache has dtype {kv_cache.dtype} and the model {weight}: make it with "
                         f"TokenModel(model).make_kv_cache, which takes the model's, or run under torch.autocast")
    layers = getattr(model.config, "num_hidden_layers", 0)
    if kv_cache.dim() > 0 and kv_cache.shape[0] < layers:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} holds {kv_cache.shape[0]} layers and the model has "
                         f"{layers}: make it with TokenModel(model).make_kv_cache")
    width = mla.row_width(model.config, latent_fp8.DTYPE if fp8 else kv_cache.dtype) if latent else None
    if kv_cache.dim() == want and (not latent or kv_cache.shape[-1] == width):
        return
    kind = ("a latent cache [layers, (sequences,) max_seq, kv_lora_rank + qk_rope_head_dim] (FP8 rows: uint8 "
            f"[..., {mla.row_width(model.config, latent_fp8.DTYPE)}])") if latent else \
        "a cache [layers, 2, (sequences,) max_seq, kv heads, head_dim]"
    if slots is not None:
        raise ValueError(f"slots need a multi-sequence kv_cache ({kind}, with the sequences dimension), got "
                         f"{tuple(kv_cache.shape)}: make it with make_kv_cache(max_seq_len, sequences=N)")
    raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not what this model takes: {kind}, without the "
                     f"sequences dimension. Make it with TokenModel(model).make_kv_cache(max_seq_len)")


def _head_dim(config) -> int:
    if getattr(config, "kv_lora_rank", None):  # MLA: per-head keys (nope + rope) and values, one width for both
        return max(config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _kv_heads(model: nn.Module) -> int:
    c = model.config
    heads = c.num_attention_heads if getattr(c, "kv_lora_rank", None) else (
        getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    return heads // getattr(model, "piecewise_world_size", 1)  # this rank's


def bytes_per_token(model: nn.Module, dtype=None) -> int:
    """Bytes of cache one token takes over all layers, indexer key caches included."""
    c = model.config
    weight_dtype = next(model.parameters()).dtype
    _check_dtype(model, dtype)
    index_dtype = weight_dtype if latent_fp8.is_fp8_dtype(dtype) else (dtype or weight_dtype)
    index = sum(m.head_dim for m in dsa.indexers(model)) * index_dtype.itemsize if dsa.is_indexed(c) else 0
    if mla.uses_latent_cache(model):
        return c.num_hidden_layers * mla.row_bytes(c, dtype or weight_dtype) + index
    return c.num_hidden_layers * 2 * _kv_heads(model) * _head_dim(c) * (dtype or weight_dtype).itemsize + index


def _check_dtype(model: nn.Module, dtype) -> None:
    if latent_fp8.is_fp8_dtype(dtype) and not mla.uses_latent_cache(model):
        raise ValueError(f"an FP8 cache ({dtype}) is for MLA models' latent cache only; this model caches per-head "
                         f"keys and values: leave dtype at the model's")


def make(model: nn.Module, max_seq_len: int, sequences: int | None = None, device=None, dtype=None) -> torch.Tensor:
    """A zeroed cache (see ``TokenModel.make_kv_cache``), and the indexers' key caches where the model has them."""
    c = model.config
    weight = next(model.parameters())
    device, dtype = device or weight.device, dtype or weight.dtype
    _check_dtype(model, dtype)
    if dsa.is_indexed(c):  # the indexer's key caches, beside this one: buffers of the indexers (FP8: bf16 keys)
        dsa.make_index_caches(model, max_seq_len, sequences, device,
                              weight.dtype if latent_fp8.is_fp8_dtype(dtype) else dtype)
    if mla.uses_latent_cache(model):
        return mla.make_latent_cache(model, max_seq_len, sequences, device, dtype)
    shape = (max_seq_len, _kv_heads(model), _head_dim(c))
    return torch.zeros(c.num_hidden_layers, 2, *(shape if sequences is None else (sequences, *shape)), device=device,
                       dtype=dtype)
