"""The 128x4 swizzled scale layout (cuBLAS ``VEC16_UE4M3``, used by NVFP4 GEMMs on Blackwell).

Scales [M, Kb] (Kb = K/16) are padded to [round_up(M, 128), round_up(Kb, 4)] with zeros and cut into tiles of
128 rows x 4 columns, stored tile after tile (row of tiles major); inside a tile, scale (r, c) sits at
``(r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4``. So the flat offset of scale (r, c) is

    tile   = (r // 128) * (padded Kb / 4) + c // 4
    offset = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4

The swizzled tensor is returned as [round_up(M, 128), round_up(Kb, 4)] holding that flat buffer.
"""

from __future__ import annotations

import torch

TILE_ROWS = 128
TILE_COLS = 4


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the swizzled form of a [rows, cols] scale matrix."""
    return round_up(rows, TILE_ROWS), round_up(cols, TILE_COLS)


def swizzled_offset(row: torch.Tensor, col: torch.Tensor, padded_cols: int) -> torch.Tensor:
    """Flat offset of scale (row, col) in the swizzled buffer (elementwise on integer tensors)."""
    tile = (row // TILE_ROWS) * (padded_cols // TILE_COLS) + col // TILE_COLS
    return tile * 512 + (row % 32) * 16 + ((row % TILE_ROWS) // 32) * 4 + col % TILE_COLS


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Linear scales [M, Kb] → swizzled [round_up(M, 128), round_up(Kb, 4)], padding zeroed (same dtype)."""
    if scales.dim() != 2:
        raise ValueError(f"swizzle_scales expects a 2-D [rows, K/16] scale matrix, got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    raw = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    padded = torch.zeros((padded_rows, padded_cols), dtype=raw.dtype, device=raw.device)
    padded[:rows, :cols] = raw
    # [row tiles, 4 row groups of 32, 32, col tiles, 4] → [row tiles, col tiles, 32, 4 row groups, 4]
    tiles = padded.view(padded_rows // TILE_ROWS, 4, 32, padded_cols // TILE_COLS, TILE_COLS)
    swizzled = tiles.permute(0, 3, 2, 1, 4).contiguous().view(padded_rows, padded_cols)
    return swizzled.view(scales.dtype)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Swizzled scales → linear [rows, cols] (inverse of ``swizzle_scales``; drops the padding)."""
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    if swizzled.numel() != padded_rows * padded_cols:
        raise ValueError(
            f"swizzled scales hold {swizzled.numel()} values but [{rows}, {cols}] scales swizzle to "
            f"[{padded_rows}, {padded_cols}]: pass the row count and K/16 of the original matrix"
        )
    raw = swizzled.view(torch.uint8) if swizzled.element_size() == 1 else swizzled
    tiles = raw.reshape(padded_rows // TILE_ROWS, padded_cols // TILE_COLS, 32, 4, TILE_COLS)
    padded = tiles.permute(0, 3, 2, 1, 4).reshape(padded_rows, padded_cols)
    return padded[:rows, :cols].contiguous().view(swizzled.dtype)
