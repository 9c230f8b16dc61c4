"""Triton NVFP4 quantize and dequantize kernels (any GPU Triton supports; no Blackwell-only instructions).

E2M1 rounding, the E4M3 scale cast and the E4M3 decode are done in plain float/integer arithmetic, so the
kernels run on sm_90 and under ``TRITON_INTERPRET=1``, and match ``reference.py`` byte for byte: the same
float32 operations in the same order, divisions with ``div_rn`` (Triton's ``/`` is an approximate division).
Scales are written and read as raw bytes (uint8 views of the ``float8_e4m3fn`` tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import swizzled_shape
from .reference import BLOCK

_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)
_QUANT_BLOCK_ROWS = 8
_QUANT_BLOCK_GROUPS = 32  # scale blocks per program along K: 512 elements
_QUANT_WARPS = 2


@triton.jit
def e4m3_round(value):
    """Round non-negative float32 ``value`` (≤ 448) to the nearest E4M3 value, ties to even → (float32, byte)."""
    bits = value.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    # Spacing of E4M3 values around ``value``: 2^(e-3) for normals (e ≥ -6), 2^-9 for subnormals.
    spacing_exp = tl.maximum(exponent - 127 - 3, -9)
    spacing = ((spacing_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_spacing = ((127 - spacing_exp) << 23).to(tl.float32, bitcast=True)
    units = value * inv_spacing  # exact: a power-of-two scaling, units < 16
    # Round to nearest even integer: adding 2^23 leaves no fraction bits (units < 2^22), subtracting is exact.
    rounded = ((units + 8388608.0) - 8388608.0) * spacing
    rounded_bits = rounded.to(tl.int32, bitcast=True)
    rounded_exp = (rounded_bits >> 23) & 0xFF
    normal_byte = ((rounded_exp - 120) << 3) | ((rounded_bits >> 20) & 0x7)
    subnormal_byte = (rounded * 512.0).to(tl.int32)
    byte = tl.where(rounded_exp >= 121, normal_byte, subnormal_byte)
    return rounded, byte


@triton.jit
def e4m3_decode(byte):
    """E4M3 byte (int32, sign bit unused: scales are non-negative) → float32."""
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa · 2^-9
    return tl.where(exponent > 0, normal, subnormal)


@triton.jit
def e2m1_code(scaled, sign_mask):
    """float32 → 4-bit E2M1 code (int32) of ``scaled`` clamped to [-6, 6], ties to the even code; the sign bit
    is the sign bit of ``scaled`` where ``sign_mask`` is 8, and 0 where it is 0.

    Round to nearest even on the grid's spacing: 0.5 below 2, 1 in [2, 4), 2 from 4. With d = max(exponent, 0)
    (0, 1, 2), ``u = |x| · 2^(1-d)`` is exact, and ``rint(u) + 2d`` is the code: an even rint(u) is an even code.
    """
    bits = scaled.to(tl.int32, bitcast=True)
    magnitude = tl.minimum(tl.abs(scaled), 6.0)
    biased = tl.maximum(magnitude.to(tl.int32, bitcast=True) >> 23, 127)  # exponent + 127, at least 127
    units = magnitude * ((255 - biased) << 23).to(tl.float32, bitcast=True)  # |x| · 2^(1-d) < 8, exact
    # Adding 2^23 rounds u half to even and leaves rint(u) in the low mantissa bits: 0x4B000000 + rint(u).
    rounded_bits = (units + 8388608.0).to(tl.int32, bitcast=True)
    return (rounded_bits + 2 * biased - (0x4B000000 + 254)) | ((bits >> 28) & sign_mask)


@triton.jit
def e2m1_value(code):
    """4-bit E2M1 code (int32) → float32 value."""
    magnitude_code = code & 0x7
    # Codes 2..7 are normal numbers 2^(e-1) · (1 + m/2): exponent field e = code >> 1, mantissa bit m = code & 1.
    normal = ((magnitude_code << 22) + (126 << 23)).to(tl.float32, bitcast=True)
    magnitude = tl.where(magnitude_code >= 2, normal, magnitude_code.to(tl.float32) * 0.5)
    return tl.where((code & 0x8) != 0, -magnitude, magnitude)


@triton.jit
def _div6(value):
    """``value / 6`` correctly rounded, without a division: an FMA-corrected product with RN(1/6).

    Exact quotients m/6 lie at least 1/6 ulp from a rounding midpoint, and the corrected product is within
    ~2^-24 ulp of the quotient, so it rounds the same way (checked for every float32 significand)."""
    inverse = 0.16666666666666666
    quotient = value * inverse
    remainder = tl.math.fma(-quotient, 6.0, value)
    return tl.math.fma(remainder, inverse, quotient)


@triton.jit
def _pack_half(codes, BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """8 codes per block → 4 bytes, the first code in the low nibble."""
    low, high = tl.split(tl.reshape(codes, (BLOCK_ROWS, BLOCK_GROUPS, 4, 2)))
    return (low | (high << 4)).to(tl.uint8)


@triton.jit
def _quantize_kernel(
    x_ptr, global_scale_ptr, packed_ptr, scales_ptr,
    rows, groups, stride_x_row, scale_rows, scale_cols,
    SWIZZLE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
):
    # The grid covers scale_rows x scale_cols (padded when swizzled) so padding scales are written as zeros.
    # Each block of 16 is loaded as two halves of 8 with the same layout, so one thread holds a whole block:
    # the block maximum needs no shuffle, and the per-block scale arithmetic runs once, not once per thread.
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    lane = tl.arange(0, 8)[None, None, :]
    row3 = row[:, None, None]
    group3 = group[None, :, None]
    in_bounds = (row3 < rows) & (group3 < groups)
    first = x_ptr + row3 * stride_x_row + group3 * 16 + lane
    x_low = tl.load(first, mask=in_bounds, other=0.0).to(tl.float32)
    x_high = tl.load(first + 8, mask=in_bounds, other=0.0).to(tl.float32)
    global_scale = tl.load(global_scale_ptr)

    amax = tl.maximum(tl.max(tl.abs(x_low), axis=2), tl.max(tl.abs(x_high), axis=2))
    target = tl.minimum(_div6(global_scale * amax), 448.0)
    scale, scale_byte = e4m3_round(target)
    nonzero = scale > 0.0
    ratio = tl.where(nonzero, tl.math.div_rn(global_scale, tl.where(nonzero, scale, 1.0)), 0.0)
    sign_mask = tl.where(nonzero, 8, 0)  # an all-zero block gives code 0 everywhere, -0 included
    code_low = e2m1_code(x_low * ratio[:, :, None], sign_mask[:, :, None])
    code_high = e2m1_code(x_high * ratio[:, :, None], sign_mask[:, :, None])

    out = packed_ptr + row3 * (groups * 8) + group3 * 8 + tl.arange(0, 4)[None, None, :]
    tl.store(out, _pack_half(code_low, BLOCK_ROWS, BLOCK_GROUPS), mask=in_bounds)
    tl.store(out + 4, _pack_half(code_high, BLOCK_ROWS, BLOCK_GROUPS), mask=in_bounds)

    row2 = row[:, None]
    group2 = group[None, :]
    if SWIZZLE:
        tile = (row2 // 128) * (scale_cols // 4) + group2 // 4
        offset = tile * 512 + (row2 % 32) * 16 + ((row2 % 128) // 32) * 4 + group2 % 4
    else:
        offset = row2 * scale_cols + group2
    scale_mask = (row2 < scale_rows) & (group2 < scale_cols)
    tl.store(scales_ptr + offset, scale_byte.to(tl.uint8), mask=scale_mask)


@triton.jit
def _dequantize_kernel(
    packed_ptr, scales_ptr, global_scale_ptr, out_ptr,
    rows, groups,
    BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    row3 = row[:, None, None]
    group3 = group[None, :, None]
    mask = (row3 < rows) & (group3 < groups)
    half = tl.arange(0, 8)[None, None, :]
    packed = tl.load(packed_ptr + row3 * (groups * 8) + group3 * 8 + half, mask=mask, other=0).to(tl.int32)
    scale_mask = (row[:, None] < rows) & (group[None, :] < groups)
    scale_byte = tl.load(scales_ptr + row[:, None] * groups + group[None, :], mask=scale_mask, other=0)
    scale = e4m3_decode(scale_byte.to(tl.int32))
    global_scale = tl.load(global_scale_ptr)

    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_ROWS, BLOCK_GROUPS, 16))
    values = tl.math.div_rn(e2m1_value(codes) * scale[:, :, None], global_scale)
    lane = tl.arange(0, 16)[None, None, :]
    out = out_ptr + row3 * (groups * 16) + group3 * 16 + lane
    tl.store(out, values.to(out_ptr.dtype.element_ty), mask=mask)


def _check_global_scale(global_scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    if global_scale.numel() != 1 or global_scale.dtype != torch.float32 or global_scale.device != device:
        raise ValueError(
            f"global_scale must be a one-element float32 tensor on {device}, got {global_scale.dtype} "
            f"{tuple(global_scale.shape)} on {global_scale.device}"
        )
    return global_scale.reshape(())


def quantize_triton(x: torch.Tensor, global_scale: torch.Tensor, swizzle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton NVFP4 quantize of ``x`` [M, K] (CUDA): (packed uint8 [M, K/2], e4m3 scales, linear or swizzled)."""
    if x.dim() != 2 or x.dtype not in _FLOAT_INPUTS:
        raise ValueError(f"quantize expects a 2-D bf16/fp16/fp32 tensor, got {x.dtype} {tuple(x.shape)}")
    rows, cols = x.shape
    if cols % BLOCK:
        raise ValueError(f"quantize needs K (last dim) a multiple of {BLOCK}, got K={cols}")
    if x.stride(1) != 1:
        x = x.contiguous()
    global_scale = _check_global_scale(global_scale, x.device)
    groups = cols // BLOCK
    scale_rows, scale_cols = swizzled_shape(rows, groups) if swizzle else (rows, groups)
    packed = torch.empty((rows, cols // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((scale_rows, scale_cols), dtype=torch.float8_e4m3fn, device=x.device)
    if scales.numel() == 0:
        return packed, scales
    grid = (triton.cdiv(scale_rows, _QUANT_BLOCK_ROWS), triton.cdiv(scale_cols, _QUANT_BLOCK_GROUPS))
    _quantize_kernel[grid](
        x, global_scale, packed, scales.view(torch.uint8),
        rows, groups, x.stride(0), scale_rows, scale_cols,
        SWIZZLE=swizzle, BLOCK_ROWS=_QUANT_BLOCK_ROWS, BLOCK_GROUPS=_QUANT_BLOCK_GROUPS, num_warps=_QUANT_WARPS,
    )
    return packed, scales


def dequantize_triton(
    packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Triton NVFP4 dequantize: packed uint8 [M, K/2] + linear e4m3 scales [M, K/16] → [M, K] ``dtype``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    rows, half_cols = packed.shape
    if (half_cols * 2) % BLOCK:
        raise ValueError(f"packed holds K={half_cols * 2} elements per row; K must be a multiple of {BLOCK}")
    groups = half_cols * 2 // BLOCK
    if scales.dtype != torch.float8_e4m3fn or tuple(scales.shape) != (rows, groups):
        raise ValueError(
            f"scales must be float8_e4m3fn [{rows}, {groups}] (linear layout), got {scales.dtype} {tuple(scales.shape)}"
        )
    if dtype not in _FLOAT_INPUTS:
        raise ValueError(f"dequantize output dtype must be bf16, fp16 or fp32, got {dtype}")
    packed = packed.contiguous()
    scales = scales.contiguous()
    global_scale = _check_global_scale(global_scale, packed.device)
    out = torch.empty((rows, groups * BLOCK), dtype=dtype, device=packed.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(rows, _QUANT_BLOCK_ROWS), triton.cdiv(groups, _QUANT_BLOCK_GROUPS))
    _dequantize_kernel[grid](
        packed, scales.view(torch.uint8), global_scale, out, rows, groups,
        BLOCK_ROWS=_QUANT_BLOCK_ROWS, BLOCK_GROUPS=_QUANT_BLOCK_GROUPS,
    )
    return out
