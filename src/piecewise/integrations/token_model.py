"""``TokenModel``: a transformers causal LM called with flat token ids, positions, a KV cache and slots (the
shape of a serving engine's step), through the attention ``integrations.transformers.enable`` routes."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..kernels.attention import one_layout_per_call
from . import kv_cache as cache_layout
from .dsa import ATTENTION


class TokenModel(nn.Module):
    """``forward(input_ids [T], position_ids [T], kv_cache=None, slots=None) → logits [T, vocab]``.

    Without ``slots`` the tokens are one sequence; with ``slots`` [T] token t belongs to sequence ``slots[t]`` of
    a multi-sequence cache: prefill several prompts and decode many sequences in one call (a flattened batch, as
    serving engines run it). ``make_kv_cache`` gives the cache its layout (MLA models: latent rows)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.training = model.training  # the mode the wrapped model is in, not nn.Module's default

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_cache: torch.Tensor | None = None,
                slots: torch.Tensor | None = None, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``logits_rows`` [R]: only those rows' logits → [R, vocab] (transformers' ``logits_to_keep``): a prefill
        of many prompts needs one row per prompt, and the output head over every token is a quarter of a small
        model's work. For calls outside a runner (its graphs are captured without it)."""
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(f"TokenModel takes flat token ids [T] and one position per token [T], got "
                             f"{tuple(input_ids.shape)} and {tuple(position_ids.shape)}: pass ids[0] for a batch of one "
                             f"([1, T], transformers' layout), or the tokens of many sequences flattened, with slots")
        position_ids = position_ids if position_ids.dtype == torch.long else position_ids.long()  # (int32: numpy's)
        keep = {} if logits_rows is None else {"logits_to_keep": logits_rows}
        extra = {} if kv_cache is None else {"piecewise_kv_cache": kv_cache, "piecewise_positions": position_ids}
        if slots is not None:
            if kv_cache is None:
                raise ValueError("slots need a multi-sequence kv_cache: make_kv_cache(max_seq_len, sequences=N)")
            extra["piecewise_slots"] = slots
        call = getattr(self.model, "_piecewise_call", None)  # set by enable(): read by every attention module
        if call is None:  # not enabled: nothing would read the cache, slots or positions
            if extra:  # transformers' own attention would never read the cache: decode steps would see one token
                raise ValueError("TokenModel got a KV cache, which transformers' own attention never reads: call "
                                 "piecewise.integrations.transformers.enable(model) before TokenModel(model)")
            return self.model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False,
                              **keep).logits[0]
        attention = getattr(self.model.config, "_attn_implementation", ATTENTION)
        if extra and attention != ATTENTION:  # set_attn_implementation(...) since enable(): the cache goes unread
            raise ValueError(
                f"TokenModel got a KV cache, but the model's attention is transformers' {attention!r} now "
                f"(set_attn_implementation or config._attn_implementation changed it after enable()), which never "
                f"reads the cache: decode steps would see their own token only. Call "
                f"piecewise.integrations.transformers.enable(model) again, or use transformers' own generate")
        if kv_cache is not None:
            cache_layout.check_cache(self.model, kv_cache, slots)
        call.clear()
        call.update(extra)
        try:
            # A long prefill's layout read once, not once per layer; not where Dynamo traces this forward (the
            # compiled code calls the attention op at run time, outside any context manager it traced).
            with contextlib.nullcontext() if torch.compiler.is_compiling() else one_layout_per_call():
                out = self.model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, **keep)
        finally:
            call.clear()
        return out.logits[0]

    def kv_bytes_per_token(self, dtype=None) -> int:
        """Bytes of cache one token takes over all layers (``make_kv_cache``'s, indexer key caches included)."""
        return cache_layout.bytes_per_token(self.model, dtype)

    def make_kv_cache(self, max_seq_len: int, sequences: int | None = None, device=None, dtype=None) -> torch.Tensor:
        """A zeroed cache for ``forward``'s ``kv_cache``: [layers, 2, max_seq_len, kv heads, head_dim] for one
        sequence, or [layers, 2, sequences, max_seq_len, kv heads, head_dim] for ``slots``; for MLA models
        [layers, (sequences,) max_seq_len, kv_lora_rank + qk_rope_head_dim]; for those, ``dtype="fp8"`` (or
        ``torch.float8_e4m3fn``) makes FP8 rows (``kernels.latent_fp8``: uint8 [..., 656] for DeepSeek-V3 and
        GLM-5, 57% of bf16's bytes; indexer key caches stay in the model's dtype). ``kv_bytes_per_token`` says what
        a token costs in it."""
        return cache_layout.make(self.model, max_seq_len, sequences, device, dtype)
