"""FP8 rows of an MLA latent cache, in the layout of DeepSeek's FlashMLA sparse kernels ("fp8_ds_mla").

A row holds one position's latent (R = kv_lora_rank values) and rotated key (P = qk_rope_head_dim values) as
bytes: the R latent values in float8 e4m3, one float32 scale per tile of ``TILE`` latent values (the tile's
largest magnitude over 448, float8 e4m3's largest), then the P rotated-key values in bfloat16, which rotary
phases make too wide-ranging for float8. DeepSeek-V3 and GLM-5 (R = 512, P = 64): 512 + 16 + 128 = 656 bytes a
row, against 1152 in bfloat16. The cache tensor is ``torch.uint8`` [..., ``row_bytes(R, P)``]; the latent part
of a row is read back as ``float8 · scale``, the rotated part exactly as written in bfloat16.

``quantize_rows`` writes rows (capturable: no host sync), ``dequantize_rows`` reads them back (the PyTorch path;
the Triton kernel of ``kernels.mla`` reads the bytes itself).
"""

from __future__ import annotations

import torch

DTYPE = torch.float8_e4m3fn
"""The latent values' type."""
TILE = 128
"""Latent values per scale where kv_lora_rank is a multiple of it; otherwise the whole latent shares one."""
FP8_MAX = 448.0
"""float8 e4m3's largest finite value."""
ROPE_DTYPE = torch.bfloat16


def is_fp8_dtype(dtype) -> bool:
    """Whether a cache dtype asks for FP8 rows: ``torch.float8_e4m3fn`` or the string ``"fp8"`` (vLLM's
    ``kv_cache_dtype``)."""
    return dtype == DTYPE or (isinstance(dtype, str) and dtype.lower() in ("fp8", "fp8_e4m3", "fp8_ds_mla"))


def tile(latent: int) -> int:
    return TILE if latent % TILE == 0 else latent


def row_bytes(latent: int, rope: int) -> int:
    """Bytes of one row: ``latent`` float8 values, one float32 scale per tile, ``rope`` bfloat16 values."""
    if latent % 4 or rope % 2:
        raise ValueError(f"an FP8 latent cache needs kv_lora_rank a multiple of 4 and qk_rope_head_dim even; got "
                         f"{latent} and {rope}")
    return latent + 4 * (latent // tile(latent)) + 2 * rope


def quantize_rows(latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """latent [..., R], k_rope [..., P] → uint8 rows [..., ``row_bytes(R, P)``]."""
    r = latent.shape[-1]
    lead = latent.shape[:-1]
    tiles = latent.float().reshape(*lead, r // tile(r), tile(r))
    scale = tiles.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [..., tiles, 1]
    values = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(DTYPE).reshape(*lead, r)
    return torch.cat([values.view(torch.uint8), scale.squeeze(-1).contiguous().view(torch.uint8),
                      k_rope.to(ROPE_DTYPE).contiguous().view(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, latent: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows [..., ``row_bytes(latent, P)``] → [..., latent + P] in ``dtype`` (the latent part as float8 ·
    its tile's scale, the rotated part as stored)."""
    tiles = latent // tile(latent)
    rows = rows.contiguous()
    values = rows[..., :latent].view(DTYPE).float()
    scale = rows[..., latent:latent + 4 * tiles].contiguous().view(torch.float32)  # [..., tiles]
    values = (values.reshape(*rows.shape[:-1], tiles, -1) * scale[..., None]).reshape(*rows.shape[:-1], latent)
    rope = rows[..., latent + 4 * tiles:].contiguous().view(ROPE_DTYPE)
    return torch.cat([values.to(dtype), rope.to(dtype)], dim=-1)
