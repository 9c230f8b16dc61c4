"""Quantize, dequantize and W4A16 linear: argument checks, then CUDA → Triton op, CPU → reference."""

from __future__ import annotations

import torch

from .checks import check_gemm_inputs
from .layout import swizzle_scales, swizzled_shape, unswizzle_scales
from .ops import dequantize_op, quantize_op, w4a16_linear_op
from .reference import (
    BLOCK,
    E2M1_MAX,
    E4M3_MAX,
    check_finite,
    dequantize_reference,
    linear_reference,
    quantize_reference,
)

_SMALLEST_E4M3 = 2.0**-9
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def global_scale_for(x: torch.Tensor) -> torch.Tensor:
    """Encode global scale ``448·6 / amax(x)`` as a 0-d float32 tensor on x's device (no host sync).

    An all-zero ``x`` gets 1.0 (any scale encodes zeros). amax is floored at 1e-30 so the scale stays finite.
    """
    amax = x.detach().abs().amax().float()
    scale = torch.full_like(amax, E4M3_MAX * E2M1_MAX) / amax.clamp_min(1e-30)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _skip_value_checks(x: torch.Tensor) -> bool:
    """Value checks need a host sync: skipped while tracing and during CUDA-graph capture."""
    if torch.compiler.is_compiling():
        return True
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _scale_tensor(global_scale: torch.Tensor | float, device: torch.device, name: str) -> torch.Tensor:
    if isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1:
            raise ValueError(f"{name} must be a float or a one-element tensor, got shape {tuple(global_scale.shape)}")
        return global_scale.detach().reshape(()).to(device=device, dtype=torch.float32)
    value = float(global_scale)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be positive and finite, got {value}: use global_scale_for(x)")
    return torch.full((), value, dtype=torch.float32, device=device)


def _check_quantize_values(x: torch.Tensor, global_scale: torch.Tensor) -> None:
    check_finite(x)
    amax, scale = torch.stack([x.detach().abs().amax().float(), global_scale]).tolist()
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"global_scale must be positive and finite, got {scale}: use global_scale_for(x)")
    if amax > 0 and scale * amax / E2M1_MAX <= _SMALLEST_E4M3 / 2:
        raise ValueError(
            f"global_scale={scale:.4g} with amax(x)={amax:.4g} makes every block scale underflow E4M3, so x "
            f"would quantize to all zeros. global_scale is the encode scale 448·6/amax (= {2688 / amax:.4g} "
            f"here, see global_scale_for); a decode scale amax/2688 from a checkpoint must be inverted first"
        )


def quantize(
    x: torch.Tensor, global_scale: torch.Tensor | float, *, swizzle: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize ``x`` [M, K] (bf16/fp16/fp32, K a multiple of 16).

    ``global_scale`` is the encode scale ``448·6 / amax`` (``global_scale_for(x)``), a float or a one-element
    tensor. Returns ``packed`` uint8 [M, K/2] (element 2j in the low nibble of byte j) and ``scales``
    ``float8_e4m3fn``: [M, K/16] linear, or with ``swizzle=True`` the 128x4 layout as
    [round_up(M, 128), round_up(K/16, 4)] with zeroed padding.

    Raises ValueError for a bad shape/dtype, NaN or Inf in ``x``, a non-positive scale, or a scale so small
    that every block underflows (the usual sign of passing the decode scale). The value checks synchronise
    with the GPU, so they are skipped under ``torch.compile`` tracing and CUDA-graph capture, where non-finite
    inputs give unspecified (but memory-safe) output.
    """
    if x.dim() != 2 or x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"quantize expects a 2-D bf16/fp16/fp32 tensor [M, K], got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] % BLOCK:
        raise ValueError(
            f"quantize needs K (the last dim) to be a multiple of {BLOCK} (one scale per {BLOCK} elements), got "
            f"K={x.shape[1]}: pad the tensor with zeros to a multiple of {BLOCK}"
        )
    scale = _scale_tensor(global_scale, x.device, "global_scale")
    if not _skip_value_checks(x):
        _check_quantize_values(x, scale)
    if x.is_cuda:
        return quantize_op(x, scale, swizzle)
    packed, scales = quantize_reference(x, scale)
    return packed, (swizzle_scales(scales) if swizzle else scales)


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | float,
    *,
    dtype: torch.dtype = torch.bfloat16,
    swizzled: bool = False,
) -> torch.Tensor:
    """Inverse of ``quantize``: ``e2m1(q) · s_b / global_scale`` → [M, K] in ``dtype``.

    ``global_scale`` is the same encode scale given to ``quantize``. ``swizzled=True`` reads scales in the
    128x4 layout ([round_up(M, 128), round_up(K/16, 4)]).
    """
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a 2-D uint8 tensor [M, K/2], got {packed.dtype} {tuple(packed.shape)}")
    rows, cols = packed.shape[0], packed.shape[1] * 2
    if cols % BLOCK:
        raise ValueError(f"packed holds K={cols} elements per row; NVFP4 needs K a multiple of {BLOCK}")
    if dtype not in _INPUT_DTYPES:
        raise ValueError(f"dequantize dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    if scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"scales must be torch.float8_e4m3fn, got {scales.dtype}")
    groups = cols // BLOCK
    if swizzled:
        scales = unswizzle_scales(scales, rows, groups)
    elif tuple(scales.shape) != (rows, groups):
        hint = " (they look swizzled: pass swizzled=True)" if scales.numel() == _numel(swizzled_shape(rows, groups)) else ""
        raise ValueError(f"scales must be [{rows}, {groups}] for packed {tuple(packed.shape)}, got {tuple(scales.shape)}{hint}")
    scale = _scale_tensor(global_scale, packed.device, "global_scale")
    if packed.is_cuda:
        return dequantize_op(packed, scales, scale, dtype)
    return dequantize_reference(packed, scales, scale, dtype)


def _numel(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1]


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A16 ``x @ W.T + bias`` with W = ``e2m1(weight) · weight_scale · weight_scale_2``.

    ``x`` [..., K]; ``weight`` packed uint8 [N, K/2]; ``weight_scale`` e4m3 [N, K/16] (linear layout);
    ``weight_scale_2`` the one-element float32 *decode* scale amax/2688. On CUDA ``x`` must be bf16 or fp16
    (the output has its dtype) and the Triton GEMM runs; on CPU the reference (dequantize, then matmul).
    Shapes are checked by the kernel's host wrapper; values are not (no host sync: safe to capture).
    """
    leading = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        check_gemm_inputs(x2d, weight, weight_scale, weight_scale_2, bias)
        out = w4a16_linear_op(x2d, weight, weight_scale, weight_scale_2, bias)
    else:
        out = linear_reference(x2d, weight, weight_scale, weight_scale_2, bias)
    return out.reshape(*leading, weight.shape[0])
