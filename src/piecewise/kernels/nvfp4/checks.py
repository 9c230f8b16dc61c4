"""Operand checks shared by the public functions (at trace time) and the kernels' host wrappers."""

from __future__ import annotations

import torch

from .reference import BLOCK


def check_gemm_inputs(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, decode_scale: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Raise ValueError unless the W4A16 operands have the dtypes, shapes and devices the kernel needs."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"W4A16 linear expects 2-D bf16/fp16 activations, got {x.dtype} {tuple(x.shape)}")
    if weight.dim() != 2 or weight.dtype != torch.uint8:
        raise ValueError(f"NVFP4 weight must be packed uint8 [N, K/2], got {weight.dtype} {tuple(weight.shape)}")
    out_features, half_k = weight.shape
    in_features = x.shape[1]
    if half_k * 2 != in_features or in_features % BLOCK:
        raise ValueError(
            f"activations have K={in_features} but the packed weight holds {half_k * 2} per row; "
            f"K must match and be a multiple of {BLOCK}"
        )
    if scales.dtype != torch.float8_e4m3fn or tuple(scales.shape) != (out_features, in_features // BLOCK):
        raise ValueError(
            f"weight scales must be float8_e4m3fn [{out_features}, {in_features // BLOCK}] in the linear layout, "
            f"got {scales.dtype} {tuple(scales.shape)} (unswizzle_scales converts a swizzled one)"
        )
    if decode_scale.numel() != 1 or decode_scale.dtype != torch.float32:
        raise ValueError(f"decode scale must be a one-element float32 tensor, got {decode_scale.dtype} {tuple(decode_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias must have shape [{out_features}], got {tuple(bias.shape)}")
    tensors = [x, weight, scales, decode_scale] + ([bias] if bias is not None else [])
    if any(t.device != x.device for t in tensors):
        raise ValueError("W4A16 linear operands must all be on one device: move the module with .to(device)")
