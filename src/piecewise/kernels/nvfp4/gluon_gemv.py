"""Host side of the three Gluon W4A16 kernels: decode (1..16 tokens, below), wgmma (17..255 tokens on Hopper,
``_gluon_wgmma``: it reuses this kernel's weight loads and decode) and prefill (from 256 tokens on Hopper,
``_gluon_prefill``: the weight decoded into shared memory), the last two at the end of this module.

Decode kernel (M ≤ 16 tokens): mma.sync fed straight from 16-byte weight loads.

The product is computed transposed, ``out.T = W · x.T``, with ``mma.m16n8k16``: the weight is operand A (16
rows × 16 k per instruction), the tokens operand B (8 columns; 16 tokens take two). No shared memory in the
loop and no repacking of the weight: the K order inside the tensor cores is a free choice as long as A and B
agree, so each
thread loads 16 *contiguous* bytes of a weight row (32 codes) and the matching 32 contiguous activations,
and the kernel maps them onto the fragment slots the thread owns:

- a warp covers 16·``ROW_TILES`` weight rows and one 128-code step of K at a time; lane ``4g + t`` holds rows
  ``g`` and ``g + 8`` of each 16-row tile, codes ``32t .. 32t + 31`` of the step;
- the lane's 32 codes come as 4 words; codes ``c`` and ``c + 4`` of word ``i`` lie 16 bits apart, so the decode
  (``ptx.DECODE_SHIFT_ASM``) makes them one register with shifts and masks alone, and that register is a
  fragment slot pair: mma step ``2i + c1``, slots ``8c0 + 2t + {0, 1}`` (``c = c0 + 2c1``). The activations
  take the same permutation (their pairs are 4 apart in memory: a register shuffle), so the sum over K is
  unchanged.

The weight keeps the public layout (``[N, K/2]`` bytes, linear E4M3 scales): nothing is repacked. The decode
places each code's 3 magnitude bits as the low exponent bits and top mantissa bit of a 16-bit float (codes 0
and ±0.5 become subnormals), 4 integer operations per register pair, then one packed multiply by the block
scale folded with the format's power of two (two for fp16, whose range needs the power applied first). The
weight side's reshuffle up to the mma operand layout is checked at compile time to be a register renaming
(``convert_layout(..., assert_trivial=True)``).

The warps of a program split K (``WARPS_K``) and their partial tiles are summed at the end; when K's steps do
not split evenly (K = 5632 is 44 steps of 128), each warp takes the same number of iterations and the surplus
ones of the last warps load zero activations. The loop carries
the next iteration's words, so their load is in flight during the math (loaded bytes carried through a loop
would be repacked byte by byte; straight-line prefetches are moved next to their use by the compilers).

Where the time goes (H200, K = N = 8192, one token, ``benchmarks/NOTES-nvfp4.md``): only reading the weight
bytes with this access pattern takes 11.1 µs; the kernel takes 17.3 µs. The decode's integer work (~1.75
integer-ALU instructions per weight, on a pipe that issues at half the FP32 rate) does not fully hide under
the loads.

Needs Triton's Gluon (``triton.experimental.gluon``, Triton 3.6 to 3.9: the names that changed in between are
picked in ``_gluon_compat``) and sm_80+; ``AVAILABLE`` says whether it imported, and ``triton_gemm`` falls back to
the tl kernel if it does not compile.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from .ptx import DECODE_K_ORDER_ASM, DECODE_SHIFT_ASM
from .splitk import split_counters

try:
    from ._gluon_kernel import _gemv_kernel

    AVAILABLE = True
except Exception:  # noqa: BLE001 - a Triton without Gluon, or whose Gluon API differs: the tl kernel runs
    AVAILABLE = False
try:
    from ._gluon_wgmma import _wgmma_kernel

    WGMMA_AVAILABLE = AVAILABLE
except Exception:  # noqa: BLE001 - as above: the tl kernel runs for 17..255 tokens
    WGMMA_AVAILABLE = False
try:
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _TensorDescriptor

    from ._gluon_prefill import BLOCK_K as _PREFILL_BLOCK_K
    from ._gluon_prefill import _prefill_kernel

    PREFILL_BLOCK_K = int(_PREFILL_BLOCK_K.value)
    PREFILL_AVAILABLE = AVAILABLE
except Exception:  # noqa: BLE001 - as above: dequantize + cuBLAS runs for prefill
    PREFILL_AVAILABLE = False
    PREFILL_BLOCK_K = 64

STEP = 128
"""Codes of K per warp per step (4 threads × 32)."""
MAX_ROWS = 16
"""Token counts up to this use the kernel (two n8 column tiles)."""


@dataclass(frozen=True)
class GemvConfig:
    warps_k: int
    """Warps per program, each taking an equal share of K (a power of two)."""
    row_tiles: int = 1
    """16-row weight tiles per warp (a power of two)."""
    steps: int = 1
    """128-code steps loaded per iteration (a power of two)."""
    prefetch: int = 1
    """Iterations whose weight words are in flight ahead of the one computed (1 or 2)."""

    def __post_init__(self):
        powers = (self.warps_k, self.row_tiles, self.steps)
        if any(v < 1 or v & (v - 1) for v in powers) or self.prefetch not in (1, 2):
            raise ValueError(f"{self}: warps_k, row_tiles and steps must be powers of two, prefetch 1 or 2")


# (most tokens, (warps_k, row_tiles, steps, prefetch)) for wide layers (at least two 16-row programs per SM) and
# for narrower ones; the first row whose bound is ≥ the token count is used.
_WIDE = ((4, (4, 1, 4, 1)), (8, (4, 2, 1, 1)), (16, (4, 2, 1, 2)))
_NARROW = ((4, (8, 1, 2, 1)), (16, (4, 1, 2, 2)))


@functools.cache
def pick_gemv_config(rows: int, out_features: int, in_features: int, sms: int) -> GemvConfig | None:
    """A configuration for x [rows, K] × W [N, K], or None when K is not a multiple of 128 (the tl kernel runs).

    From sweeps on an H200 (``benchmarks/gemv_sweep.py``: 1, 4, 8 and 16 tokens on eleven layer shapes of
    Llama-style and MoE models, N from 2048 to 28672, K from 1408 to 14336; the table minimises the mean
    slowdown against each shape's best configuration): 8 warps on K for narrow layers up to 4 tokens, 4 warps
    otherwise, and from 5 tokens on wide layers two 16-row tiles per warp (each activation fragment then serves
    32 rows). Steps are halved until they divide K's 128-code steps; the warps need not divide them (the last
    warps get fewer iterations), but are halved while there are more warps than iterations.
    """
    if in_features % STEP:
        return None
    steps_total = in_features // STEP
    table = _WIDE if out_features >= 32 * sms else _NARROW
    warps, row_tiles, steps, prefetch = next(config for bound, config in table if rows <= bound)
    while steps > 1 and steps_total % steps:
        steps //= 2
    while warps > 1 and warps > steps_total // steps:
        warps //= 2
    return GemvConfig(warps_k=warps, row_tiles=row_tiles, steps=steps, prefetch=prefetch)


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def gemv_supported(rows: int, in_features: int, device_index: int) -> bool:
    """Whether the Gluon kernel can take this call (1..16 tokens, K a multiple of 128, sm_80+)."""
    return AVAILABLE and 0 < rows <= MAX_ROWS and in_features % STEP == 0 and _capability_major(device_index) >= 8


def _shared_arguments(x, weight, scales, decode_scale, bias, out) -> tuple[tuple, dict]:
    """The leading arguments and the constexprs both Gluon kernels take. They read the weight as 32-bit words:
    a weight view that does not start on a 16-byte boundary is copied first."""
    rows, in_features = x.shape
    if weight.data_ptr() % 16:
        weight = weight.clone()
    is_fp16 = x.dtype == torch.float16
    arguments = (x, weight, scales, decode_scale, bias if bias is not None else decode_scale, out,
                 rows, weight.shape[0], in_features // 2, in_features // 16, x.stride(0), out.stride(0))
    constexprs = {"HAS_BIAS": bias is not None, "IS_FP16": is_fp16, "DECODE": DECODE_SHIFT_ASM["f16" if is_fp16 else "bf16"]}
    return arguments, constexprs


def w4a16_gemv(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, decode_scale: torch.Tensor,
    bias: torch.Tensor | None, out: torch.Tensor, config: GemvConfig,
) -> torch.Tensor:
    """``out = x @ W.T (+ bias)`` for checked, contiguous operands (``scales`` as uint8); returns ``out``."""
    rows, in_features = x.shape
    total = in_features // (STEP * config.steps)
    if in_features % (STEP * config.steps):
        raise ValueError(f"K={in_features} is not a multiple of {config.steps} steps of {STEP}")
    iterations = triton.cdiv(total, config.warps_k)
    arguments, constexprs = _shared_arguments(x, weight, scales, decode_scale, bias, out)
    grid = (triton.cdiv(weight.shape[0], 16 * config.row_tiles),)
    _gemv_kernel[grid](
        *arguments, iterations, total, **constexprs,
        BLOCK_M=8 if rows <= 8 else 16, WARPS_K=config.warps_k, ROW_TILES=config.row_tiles, STEPS=config.steps,
        PREFETCH=config.prefetch, EVEN=total % config.warps_k == 0, num_warps=config.warps_k,
    )
    return out


# --- 17..255 tokens: the wgmma kernel (``_gluon_wgmma``) -------------------------------------------------------

WGMMA_ROWS = (17, 255)
"""Token counts that use the wgmma kernel (below: the decode kernel or the tl kernel; above, bf16: cuBLAS)."""


@dataclass(frozen=True)
class WgmmaConfig:
    block_m: int
    """Tokens per program (wgmma's N): 16, 32, 64 or 128."""
    warps: int
    """4 or 8: one 16-row slice of the weight per warp, so 64 or 128 weight rows per program."""
    steps: int = 1
    """128-code steps per iteration (1 or 2)."""
    split_k: int = 1
    """Programs sharing one output tile's K loop (1, 2, 4 or 8; fewer when K's iterations do not divide)."""

    def __post_init__(self):
        if (self.block_m not in (16, 32, 64, 128) or self.warps not in (4, 8) or self.steps not in (1, 2)
                or self.split_k not in (1, 2, 4, 8)):
            raise ValueError(f"{self}: block_m must be 16, 32, 64 or 128, warps 4 or 8, steps 1 or 2, "
                             f"split_k 1, 2, 4 or 8")


_WGMMA_MAX_SPLIT = 4
"""Most programs one output tile's K loop is split over."""


@functools.cache
def pick_wgmma_config(rows: int, out_features: int, in_features: int, sms: int) -> WgmmaConfig | None:
    """The wgmma kernel's configuration for x [rows, K] × W [N, K], or None outside 17..255 tokens or when K is
    not a multiple of 128.

    8 warps (128 weight rows per program), 64 tokens per program up to 128 tokens and 128 above, one 128-code
    step per iteration; K is split over 2 or 4 programs while there are fewer programs than the SMs (up to 32
    tokens) or half of them (more tokens), as long as each split keeps at least 2 whole iterations. From sweeps
    on an H200 of 21 configurations (splits of 1 to 8) at 17..192 tokens on five layer shapes (4096², 8192²,
    2048 × 5632, 4096 × 14336, 28672 × 4096; ``benchmarks/results/2026-11-30-h200-wgmma_sweep-split*.md``):
    this rule is within 6% of each case's best configuration on average, 20% at worst.
    """
    if in_features % STEP or not WGMMA_ROWS[0] <= rows <= WGMMA_ROWS[1]:
        return None
    block_m = 64 if rows <= 128 else 128
    programs = triton.cdiv(out_features, 128) * triton.cdiv(rows, block_m)
    iterations = in_features // STEP
    target = sms if rows <= 32 else sms // 2
    split = 1
    while (split < _WGMMA_MAX_SPLIT and programs * split < target and iterations % (2 * split) == 0
           and iterations // (2 * split) >= 2):
        split *= 2
    return WgmmaConfig(block_m=block_m, warps=8, steps=1, split_k=split)


def wgmma_supported(rows: int, in_features: int, device_index: int) -> bool:
    """Whether the wgmma kernel can take this call (17..255 tokens, K a multiple of 128, sm_90: wgmma is Hopper's)."""
    return (WGMMA_AVAILABLE and WGMMA_ROWS[0] <= rows <= WGMMA_ROWS[1] and in_features % STEP == 0
            and _capability_major(device_index) == 9)


def w4a16_wgmma(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, decode_scale: torch.Tensor,
    bias: torch.Tensor | None, out: torch.Tensor, config: WgmmaConfig,
) -> torch.Tensor:
    """``out = x @ W.T (+ bias)`` for checked, contiguous operands (``scales`` as uint8); returns ``out``."""
    rows, in_features = x.shape
    if in_features % (STEP * config.steps):
        raise ValueError(f"K={in_features} is not a multiple of {config.steps} steps of {STEP}")
    arguments, constexprs = _shared_arguments(x, weight, scales, decode_scale, bias, out)
    block_m = min(config.block_m, max(16, triton.next_power_of_2(rows)))
    grid_n, grid_m = triton.cdiv(weight.shape[0], 16 * config.warps), triton.cdiv(rows, block_m)
    iterations = in_features // (STEP * config.steps)
    split = config.split_k
    while split > 1 and iterations % split:
        split //= 2
    counters = split_counters(x.device, grid_n * grid_m) if split > 1 else None
    if counters is None:
        split, partials, counters = 1, out, out  # any pointers: not read without a split
    else:
        partials = torch.empty((grid_n * grid_m, split, 16 * config.warps, block_m), dtype=torch.float32,
                               device=x.device)
    _wgmma_kernel[(grid_n, grid_m, split)](
        *arguments, iterations // split, partials, counters, split, **constexprs,
        BLOCK_M=block_m, WARPS=config.warps, STEPS=config.steps, SPLIT=split > 1, num_warps=config.warps,
    )
    return out


# --- prefill: the weight decoded into shared memory (``_gluon_prefill``) ------------------------------------------


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 256
    """Tokens per program (wgmma's M, two warpgroups): 128 or 256. Each weight byte is decoded once per this many
    tokens."""
    block_n: int = 128
    """Weight rows per program (wgmma's N): 64, 128 or 256."""

    def __post_init__(self):
        if self.block_m not in (128, 256) or self.block_n not in (64, 128, 256) or self.block_m * self.block_n > 32768:
            raise ValueError(f"{self}: block_m must be 128 or 256, block_n 64, 128 or 256, not both 256 (shared memory)")


PREFILL_STAGES = 4
"""Stages of activation + packed-weight tiles (a stage is refilled two iterations after its wgmma was issued)."""


@functools.cache
def pick_prefill_config(rows: int, out_features: int, sms: int) -> PrefillConfig:
    """256 tokens per program unless that leaves more than half the SMs idle (then 128): from a sweep on an H200
    (512..4096 tokens, K = N = 4096 and 8192; ``benchmarks/results/2026-11-30-h200-nvfp4-prefill.md``)."""
    programs = triton.cdiv(rows, 256) * triton.cdiv(out_features, 128)
    return PrefillConfig(block_m=128 if 2 * programs <= sms else 256, block_n=128)


def prefill_supported(in_features: int, device_index: int) -> bool:
    """Whether the prefill kernel can take a [*, K] × [N, K] product: Gluon with Hopper TMA, sm_90, K a multiple of
    64 (``w4a16_prefill`` copies an activation view whose rows TMA cannot address)."""
    return PREFILL_AVAILABLE and in_features % PREFILL_BLOCK_K == 0 and _capability_major(device_index) == 9


def w4a16_prefill(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, decode_scale: torch.Tensor,
    bias: torch.Tensor | None, out: torch.Tensor, config: PrefillConfig,
) -> torch.Tensor:
    """``out = x @ W.T (+ bias)`` for checked operands (``scales`` as uint8, K a multiple of 64); returns ``out``."""
    rows, in_features = x.shape
    if in_features % PREFILL_BLOCK_K:
        raise ValueError(f"K={in_features} is not a multiple of {PREFILL_BLOCK_K}")
    # TMA: 16-byte aligned base and row strides, unit stride along K.
    if x.stride(1) != 1 or x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    if weight.data_ptr() % 16 or not weight.is_contiguous():
        weight = weight.clone(memory_format=torch.contiguous_format)
    is_fp16 = x.dtype == torch.float16
    x_block = [config.block_m, PREFILL_BLOCK_K]
    x_layout = _gl.NVMMASharedLayout.get_default_for(x_block, _gl.float16 if is_fp16 else _gl.bfloat16)
    x_desc = _TensorDescriptor(x, list(x.shape), list(x.stride()), x_block, x_layout)
    words = weight.view(torch.int32)  # [N, K/8]: rows of K/2 bytes, a multiple of 32
    w_block = [config.block_n, PREFILL_BLOCK_K // 8]
    w_layout = _gl.NVMMASharedLayout.get_default_for(w_block, _gl.int32)
    w_desc = _TensorDescriptor(words, list(words.shape), list(words.stride()), w_block, w_layout)
    grid = (triton.cdiv(rows, config.block_m), triton.cdiv(weight.shape[0], config.block_n))
    _prefill_kernel[grid](
        x_desc, w_desc, scales, decode_scale, bias if bias is not None else decode_scale, out,
        rows, weight.shape[0], in_features // 16, out.stride(0), in_features // PREFILL_BLOCK_K,
        HAS_BIAS=bias is not None, IS_FP16=is_fp16, DECODE=DECODE_K_ORDER_ASM["f16" if is_fp16 else "bf16"],
        STAGES=PREFILL_STAGES, num_warps=8,
    )
    return out
