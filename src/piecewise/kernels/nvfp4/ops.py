"""The NVFP4 Triton kernels as opaque ``torch.library`` ops (namespace ``piecewise_nvfp4``).

Dynamo records one call node per op and never traces the host code (Triton's launcher, its compile cache),
and the fakes give piecewise the output shapes. The ops are registered when this module is imported, which
needs no Triton; the kernel modules are imported on the first real (eager) call.
"""

from __future__ import annotations

import torch

from piecewise.opaque import opaque_op

from .layout import swizzled_shape
from .reference import BLOCK


def _quantize_fake(x: torch.Tensor, global_scale: torch.Tensor, swizzle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    groups = cols // BLOCK
    scale_shape = swizzled_shape(rows, groups) if swizzle else (rows, groups)
    packed = x.new_empty((rows, cols // 2), dtype=torch.uint8)
    return packed, x.new_empty(scale_shape, dtype=torch.float8_e4m3fn)


@opaque_op("piecewise_nvfp4::quantize", fake=_quantize_fake)
def quantize_op(x: torch.Tensor, global_scale: torch.Tensor, swizzle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton_quant import quantize_triton

    return quantize_triton(x, global_scale, swizzle)


def _dequantize_fake(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return packed.new_empty((packed.shape[0], packed.shape[1] * 2), dtype=dtype)


@opaque_op("piecewise_nvfp4::dequantize", fake=_dequantize_fake)
def dequantize_op(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from .triton_quant import dequantize_triton

    return dequantize_triton(packed, scales, global_scale, dtype)


def _linear_fake(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, decode_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@opaque_op("piecewise_nvfp4::w4a16_linear", fake=_linear_fake)
def w4a16_linear_op(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, decode_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    from .triton_gemm import w4a16_linear

    return w4a16_linear(x, weight, scales, decode_scale, bias)
