"""``NVFP4Linear``: a linear layer with an NVFP4 weight and bf16/fp16 activations (W4A16)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .functional import dequantize, global_scale_for, linear, quantize
from .reference import BLOCK


def _one_scale(value: torch.Tensor | float, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(value).detach()
    if tensor.numel() != 1 or not tensor.is_floating_point():
        raise ValueError(f"{name} must be a one-element float tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    return tensor.reshape(()).to(torch.float32)


def encode_scale_problem(value: float, name: str) -> str | None:
    """What is wrong with decode scale ``name`` = ``value``, or None. Mixing up the decode scale amax/2688 with
    the encode scale 448·6/amax is the commonest NVFP4 bug: a decode scale above 1 means a weight amax above 2688,
    which real weights never have, while an encode scale is almost always far above 1."""
    if value <= 1.0:
        return None
    return (f"{name}={value:.6g} looks like an encode scale (448·6/amax, here amax would be {2688 / value:.4g}): "
            f"checkpoints store the decode scale amax/2688. Pass its reciprocal ({1 / value:.6g})")


_SAME_SIZE_INTEGER = {torch.float8_e4m3fn: torch.uint8, torch.float32: torch.int32}


def apply_keeping_scales(module: nn.Module, names: tuple[str, ...], fn, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` that moves the buffers ``names`` (NVFP4 scales) between devices but keeps their
    dtype: ``model.to(torch.bfloat16)`` or ``.half()`` would otherwise round the E4M3 block scales and the float32
    decode scale to 16-bit floats (the CUDA kernels then refuse them; the CPU path computes with the rounded
    decode scale). The buffers go through ``fn`` as same-size integer views, which dtype conversions skip."""
    kept = {}
    for name in names:
        tensor = module._buffers.get(name)
        if tensor is not None and tensor.dtype in _SAME_SIZE_INTEGER:
            kept[name] = tensor.dtype
            module._buffers[name] = tensor.view(_SAME_SIZE_INTEGER[tensor.dtype])
    try:
        return nn.Module._apply(module, fn, recurse)
    finally:
        for name, dtype in kept.items():
            module._buffers[name] = module._buffers[name].view(dtype)


class NVFP4Linear(nn.Module):
    """``y = x @ W.T + bias`` with W stored as NVFP4, computed as W4A16 (weights dequantized inside the GEMM).

    Buffers follow the ModelOpt checkpoint names: ``weight`` packed uint8 [N, K/2] (low nibble first),
    ``weight_scale`` float8_e4m3fn [N, K/16], ``weight_scale_2`` the float32 *decode* scale amax/2688,
    ``input_scale`` (kept when a checkpoint has one; unused, activations stay 16-bit) and ``bias``.
    Build one with ``from_linear`` or ``from_checkpoint``; move it with ``.to(device)``. On CUDA the forward
    is one opaque Triton op (captures in piecewise graphs); on CPU it dequantizes and runs a matmul.
    ``.to(dtype)`` / ``.half()`` convert the bias only: the scales keep their dtypes.
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor
    input_scale: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if in_features % BLOCK or in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"NVFP4Linear needs in_features a positive multiple of {BLOCK} (one scale per {BLOCK} inputs) and "
                f"out_features > 0, got in_features={in_features}, out_features={out_features}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer(
            "weight_scale",
            torch.zeros(out_features, in_features // BLOCK, dtype=torch.float8_e4m3fn, device=device),
        )
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", None)
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, module: nn.Linear) -> "NVFP4Linear":
        """Quantize an ``nn.Linear`` (on its device; CUDA uses the Triton kernel) with gs = 448·6/amax(W)."""
        if not isinstance(module, nn.Linear):
            raise ValueError(f"NVFP4Linear.from_linear expects an nn.Linear, got {type(module).__name__}")
        weight = module.weight.detach()
        dtype = weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        layer = cls(module.in_features, module.out_features, bias=module.bias is not None, dtype=dtype,
                    device=weight.device)
        encode_scale = global_scale_for(weight)
        packed, scales = quantize(weight, encode_scale)
        layer.weight.copy_(packed)
        layer.weight_scale.copy_(scales)
        layer.weight_scale_2.copy_(torch.reciprocal(encode_scale))
        if module.bias is not None:
            layer.bias.copy_(module.bias.detach())
        return layer

    @classmethod
    def from_checkpoint(
        cls,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor | float,
        input_scale: torch.Tensor | float | None = None,
        bias: torch.Tensor | None = None,
        *,
        dtype: torch.dtype = torch.bfloat16,
        check_scale: bool = True,
    ) -> "NVFP4Linear":
        """Build from ModelOpt-style tensors (the layer lives on ``weight``'s device).

        ``weight`` uint8 [N, K/2]; ``weight_scale`` float8_e4m3fn [N, K/16] in the linear layout (use
        ``unswizzle_scales`` on a swizzled one); ``weight_scale_2`` the *decode* scale amax/2688.

        Mixing up the decode scale with the encode scale 448·6/amax is the commonest NVFP4 bug, and it is
        silent: outputs come out wrong by a factor of about (2688/amax)². A decode scale above 1 means a
        weight amax above 2688, which real weights never have, while an encode scale is almost always far
        above 1 — so ``weight_scale_2 > 1`` raises ValueError. Pass ``check_scale=False`` if your weights
        really are that large.
        """
        if weight.dtype != torch.uint8 or weight.dim() != 2:
            raise ValueError(
                f"weight must be packed FP4 as uint8 [N, K/2], got {weight.dtype} {tuple(weight.shape)}"
                + (" (use weight.view(torch.uint8))" if weight.dtype == torch.int8 else "")
            )
        out_features, in_features = weight.shape[0], weight.shape[1] * 2
        groups = in_features // BLOCK
        if in_features % BLOCK:
            raise ValueError(f"weight holds K={in_features} inputs per row; NVFP4 needs K a multiple of {BLOCK}")
        if weight_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"weight_scale must be torch.float8_e4m3fn, got {weight_scale.dtype}"
                + (" (use weight_scale.view(torch.float8_e4m3fn))" if weight_scale.dtype == torch.uint8 else "")
            )
        if tuple(weight_scale.shape) != (out_features, groups):
            raise ValueError(
                f"weight_scale must be [{out_features}, {groups}] (one per 16 inputs, linear layout), got "
                f"{tuple(weight_scale.shape)}; a swizzled 128x4 scale tensor converts with "
                f"unswizzle_scales(weight_scale, {out_features}, {groups})"
            )
        decode_scale = _one_scale(weight_scale_2, "weight_scale_2")
        value = float(decode_scale)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"weight_scale_2 must be positive and finite, got {value}")
        problem = encode_scale_problem(value, "weight_scale_2") if check_scale else None
        if problem:
            raise ValueError(f"{problem}, or check_scale=False if the weight's amax really exceeds 2688")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias must have shape [{out_features}], got {tuple(bias.shape)}")
        device = weight.device
        layer = cls(in_features, out_features, bias=bias is not None, dtype=dtype, device=device)
        layer.weight.copy_(weight)
        layer.weight_scale.copy_(weight_scale.to(device))
        layer.weight_scale_2.copy_(decode_scale.to(device))
        if input_scale is not None:
            layer.input_scale = _one_scale(input_scale, "input_scale").to(device)
        if bias is not None:
            layer.bias.copy_(bias.detach().to(device=device, dtype=dtype))
        return layer

    def _apply(self, fn, recurse=True):
        return apply_keeping_scales(self, ("weight_scale", "weight_scale_2", "input_scale"), fn, recurse)

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight as a dense [N, K] tensor (for checks and debugging)."""
        return dequantize(self.weight, self.weight_scale, torch.reciprocal(self.weight_scale_2), dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"NVFP4Linear expects inputs [..., {self.in_features}], got {tuple(x.shape)}")
        return linear(x, self.weight, self.weight_scale, self.weight_scale_2, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears(model: nn.Module, *, skip: tuple[str, ...] = ("lm_head",)) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` in place by ``NVFP4Linear.from_linear`` of it and return the
    qualified names replaced. A Linear stays as it is when its name or a parent's name is in ``skip`` (by
    default the output head, which NVFP4 checkpoints keep in 16 bits) or when its in_features is not a
    multiple of 16 (one scale per 16 inputs); compare the returned names with the model's to see which."""
    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            qualified = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or set(qualified.split(".")) & set(skip) or child.in_features % BLOCK:
                continue
            setattr(module, child_name, NVFP4Linear.from_linear(child))
            replaced.append(qualified)
    return replaced
