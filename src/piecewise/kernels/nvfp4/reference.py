"""Pure-PyTorch NVFP4: the definition the Triton kernels are tested against, and the CPU path.

NVFP4 stores a tensor as E2M1 elements (±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, two per byte, first element in the low
nibble), one FP8 E4M3 scale per block of 16 consecutive elements along the last dimension, and one float32
global scale per tensor. With the *encode* global scale ``gs = 448·6 / amax(x)``:

    s_b   = e4m3(min(gs · amax(block) / 6, 448))          saturating: clamp before the cast
    ratio = gs / s_b                                       one IEEE float32 division per block
    q     = rne_e2m1(clamp(x · ratio, -6, 6))              one float32 product per element; q = 0 if s_b == 0
    x̂     = (e2m1(q) · s_b) / gs                           float32, then cast to the output dtype

Every step above is a single correctly rounded float32 operation in this order; the Triton kernels compute the
same operations in the same order, so their bytes are identical to this reference.

Rounding to E2M1 is round-to-nearest, ties-to-even code: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4.
The sign bit is the sign of ``x`` (a negative value that rounds to zero is stored as -0, as hardware
conversions do); in an all-zero block (or one whose scale underflows E4M3) every code is +0.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
BLOCK = 16
"""Elements per scale block."""

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Value of E2M1 codes 0..7; codes 8..15 are the same magnitudes negated."""

# Decision points between consecutive magnitudes; at a tie the even code wins, so the tie goes up exactly
# when the upper code (index + 1) is even.
_BOUNDARIES = tuple((lo + hi) / 2 for lo, hi in zip(E2M1_MAGNITUDES[:-1], E2M1_MAGNITUDES[1:]))
_TIE_GOES_UP = tuple((index + 1) % 2 == 0 for index in range(len(_BOUNDARIES)))


def e2m1_values(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 E2M1 code values as float32 (index = 4-bit code, bit 3 = sign)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def rne_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, sign in bit 3) of float32 values already clamped to [-6, 6]."""
    magnitude = scaled.abs()
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for boundary, tie_up in zip(_BOUNDARIES, _TIE_GOES_UP):
        above = magnitude >= boundary if tie_up else magnitude > boundary
        code += above.to(torch.uint8)
    return code | (torch.signbit(scaled).to(torch.uint8) << 3)


def check_finite(x: torch.Tensor) -> None:
    """Raise ValueError if ``x`` holds NaN or ±Inf (their NVFP4 encoding is undefined). Synchronises on CUDA."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError(
            "NVFP4 quantize got NaN or Inf values: E2M1/E4M3 cannot represent them and one poisons the scale of "
            "its whole block; clean the tensor first (e.g. torch.nan_to_num) or find where they come from"
        )


def block_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 scale per block of 16 of ``x`` [M, K] → [M, K/16] ``torch.float8_e4m3fn``."""
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # Divide by a full tensor, not a Python number: CUDA turns division by a CPU scalar into a product with
    # its reciprocal, which is not the correctly rounded quotient the kernels compute.
    target = (global_scale * amax) / torch.full_like(amax, E2M1_MAX)
    target = torch.clamp(target, max=E4M3_MAX)  # clamp first: torch's cast to E4M3 does not saturate
    return target.to(torch.float8_e4m3fn)


def quantize_reference(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize ``x`` [M, K] with the encode scale ``global_scale`` (0-d float32).

    Returns ``packed`` uint8 [M, K/2] (first element in the low nibble) and linear ``scales`` e4m3 [M, K/16].
    Inputs are assumed finite and K a multiple of 16 (the public ``quantize`` checks both).
    """
    rows, cols = x.shape
    global_scale = global_scale.to(device=x.device, dtype=torch.float32)
    scales = block_scales(x, global_scale)
    scale_values = scales.float()
    ratio = torch.where(scale_values > 0, global_scale / scale_values, torch.zeros_like(scale_values))
    blocks = x.float().reshape(rows, cols // BLOCK, BLOCK)
    scaled = torch.clamp(blocks * ratio.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)
    codes = rne_e2m1(scaled)
    codes = torch.where((scale_values > 0).unsqueeze(-1), codes, torch.zeros_like(codes))
    codes = codes.reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, scales


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [M, K/2] → 4-bit codes uint8 [M, K] (low nibble first)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def dequantize_reference(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of ``quantize_reference``: ``(e2m1(q) · s_b) / gs`` in float32, cast to ``dtype`` → [M, K]."""
    rows = packed.shape[0]
    cols = packed.shape[1] * 2
    global_scale = global_scale.to(device=packed.device, dtype=torch.float32)
    values = e2m1_values(packed.device)[unpack_codes(packed).long()]
    blocks = values.reshape(rows, cols // BLOCK, BLOCK) * scales.float().unsqueeze(-1)
    return (blocks / global_scale).reshape(rows, cols).to(dtype)


def linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    decode_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` with W the NVFP4 weight [N, K]; ``decode_scale`` = amax/2688 (1 / encode scale).

    W is dequantized to ``x.dtype`` as ``e2m1 · s_b · decode_scale``: this equals ``dequantize_reference`` with
    ``gs = 1 / decode_scale`` up to one float32 rounding.
    """
    rows = packed.shape[0]
    cols = packed.shape[1] * 2
    decode_scale = decode_scale.to(device=packed.device, dtype=torch.float32)
    values = e2m1_values(packed.device)[unpack_codes(packed).long()]
    weight = values.reshape(rows, cols // BLOCK, BLOCK) * scales.float().unsqueeze(-1)
    weight = (weight * decode_scale).reshape(rows, cols).to(x.dtype)
    bias = bias.to(x.dtype) if bias is not None else None
    return torch.nn.functional.linear(x, weight, bias)
