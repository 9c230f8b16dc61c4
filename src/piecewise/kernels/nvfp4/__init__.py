"""NVFP4 (4-bit E2M1 elements, E4M3 scale per 16, float32 tensor scale) for Hopper and CPU.

Public API:

- ``quantize(x, global_scale, *, swizzle=False) -> (packed, scales)``
- ``dequantize(packed, scales, global_scale, *, dtype=torch.bfloat16, swizzled=False) -> Tensor``
- ``global_scale_for(x)``: the encode scale 448·6 / amax(x)
- ``linear(x, weight, weight_scale, weight_scale_2, bias=None)``: W4A16 ``x @ W.T + bias``
- ``NVFP4Linear``: an ``nn.Module`` holding an NVFP4 weight (``from_linear``, ``from_checkpoint``)
- ``quantize_linears(model, skip=("lm_head",))``: every ``nn.Linear`` of a model → ``NVFP4Linear``, in place
- ``swizzle_scales`` / ``unswizzle_scales``: the 128x4 scale layout of Blackwell GEMMs

Two scales, inverse of each other, are easy to mix up: functions here that say ``global_scale`` take the
*encode* scale ``gs = 448·6 / amax`` (FlashInfer's convention: ``quantized = x · gs / s_b``); ModelOpt/torchao
checkpoints store the *decode* scale ``weight_scale_2 = amax / 2688 = 1 / gs``, and ``linear``/``NVFP4Linear``
take that one. CUDA tensors run Triton kernels wrapped as opaque ops (they capture inside piecewise graphs);
CPU tensors run the pure-PyTorch reference, which the kernels match byte for byte.
"""

from .functional import dequantize, global_scale_for, linear, quantize
from .layout import swizzle_scales, unswizzle_scales
from .module import NVFP4Linear, quantize_linears

__all__ = [
    "NVFP4Linear",
    "dequantize",
    "global_scale_for",
    "linear",
    "quantize",
    "quantize_linears",
    "swizzle_scales",
    "unswizzle_scales",
]
