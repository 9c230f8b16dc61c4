"""Triton W4A16 GEMM: ``out = x @ W.T (+ bias)`` with W an NVFP4 weight, dequantized in registers.

Runs on sm_80+ (no FP4 hardware needed). The product is computed transposed, ``out.T = W · x.T``, so the
dequantized weight tile is the *first* dot operand: on Hopper wgmma reads that operand from registers, and the
weight never takes a round trip through shared memory. The activation tile is the second operand, for which
tl.dot needs at least 16 columns: decode (M < 16) pads the token block to 16 — the tensor cores have spare
capacity there, the kernel is bound by the weight bytes.

Weight decode (``ptx.DECODE_ASM``): inline PTX turns 4 packed bytes (8 codes) into 8 bf16/f16 values with byte
lookup tables (``prmt``), 14 instructions per 8 values, giving ``e2m1 · 2^120`` (bf16) or ``e2m1 · 2^8`` (f16).
The E4M3 block scale becomes a 16-bit float by a shift (``s · 2^-120`` / ``s · 2^-8``), and one packed multiply
gives ``e2m1 · s_b`` exactly (≤ 6 significant bits, in range). The tensor decode scale multiplies the float32
accumulator once at the end. On sm_90 the M ≤ 16 loop compiles to ~7.9 SASS instructions per weight element,
about 3 of them the decode and scale; the rest are wgmma issue, address and pipeline bookkeeping.

``w4a16_linear`` picks the kernel by token count (``select_config``, fixed rules): the Gluon decode kernel for
1..16 tokens and the Gluon wgmma kernel for 17..255 on Hopper (both need K a multiple of 128; ``gluon_gemv``);
from 256 tokens on Hopper the Gluon prefill kernel for fp16 and, up to 512 tokens on layers of at least 2^26
weights, for bf16 (K a multiple of 64); dequantize + cuBLAS for the other bf16 calls from 256 tokens on; and this
tl kernel for everything else (K not a multiple of 128, GPUs or Tritons without the Gluon
kernels).

Launch configuration comes from a fixed table keyed on M (``pick_config``), never from autotuning, so the first
call inside a CUDA-graph capture launches exactly what eager calls launch. For few output tiles (small M) the K
loop is split across programs (split-K); each split stores a float32 partial tile and the last split of a tile
to arrive (an acq_rel counter) adds the partials in split order — deterministic, one launch. From
``DENSE_FROM_ROWS`` rows on (prefill), the weight is dequantized into a scratch tensor and cuBLAS does the GEMM.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import check_gemm_inputs
from .gluon_gemv import (
    GemvConfig,
    PrefillConfig,
    WgmmaConfig,
    gemv_supported,
    pick_gemv_config,
    pick_prefill_config,
    pick_wgmma_config,
    prefill_supported,
    wgmma_supported,
)
from . import gluon_gemv
from .ptx import DECODE_ASM
from .splitk import split_counters

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GemmConfig:
    """Launch configuration of the W4A16 kernel."""

    block_m: int
    """Tokens (rows of x) per program; at least 16 (tl.dot's minimum)."""
    block_n: int
    """Output features (rows of W) per program."""
    block_k: int
    """Reduction step; a multiple of 16 (one scale block)."""
    num_warps: int
    num_stages: int
    split_k: int = 1
    """Programs sharing one output tile's K loop (1: no split)."""


# (largest M, config with split_k=1): the first row whose bound is ≥ M is used. Picked from a sweep on an
# H200 (benchmarks/nvfp4.py --sweep). Above the last bound, ``w4a16_linear`` dequantizes and calls cuBLAS.
_CONFIG_TABLE: tuple[tuple[int, GemmConfig], ...] = (
    (16, GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)),
    (32, GemmConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4)),
    (64, GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)),
    (128, GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)),
    (1 << 62, GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)),
)
DENSE_FROM_ROWS = 256
"""From this many rows on (bf16 activations), dequantizing W to a bf16 scratch and calling cuBLAS beats the
fused kernels. fp16 stays fused: weights far below 1 can fall under fp16's range once the decode scale is in."""
PREFILL_FROM_ROWS = 256
"""From this many rows on, fp16 activations on Hopper take the Gluon prefill kernel (``gluon_gemv.w4a16_prefill``)
instead of the tl kernel."""
PREFILL_BF16 = (512, 1 << 26)
"""bf16 calls of up to 512 rows on layers of at least 2^26 weights take the prefill kernel instead of dequantize +
cuBLAS: there the dequantize pass (N·K·2.6 bytes) costs more than the kernel's slower multiply, and there is no
N·K scratch (``benchmarks/results/2026-11-30-h200-nvfp4-prefill.md``: 8192² at 256 / 512 tokens 94 / 126 µs
against 100 / 143; 28672 × 4096 at 256 tokens 131 against 181, at 512 even; smaller layers lose)."""
_MAX_SPLIT_K = 16
_MIN_K_STEPS_PER_SPLIT = 2
# Programs per SM to aim for when splitting K (the M ≤ 16 config fits 7 per SM on sm_90: 92 registers, 29 KB
# of shared memory).
_PROGRAMS_PER_SM = 4


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_config(rows: int, out_features: int, in_features: int, sms: int) -> GemmConfig:
    """Configuration for x [rows, K] × W [N, K]: the table row for ``rows``, split-K when tiles are too few."""
    base = next(config for bound, config in _CONFIG_TABLE if rows <= bound)
    tiles = triton.cdiv(rows, base.block_m) * triton.cdiv(out_features, base.block_n)
    k_steps = triton.cdiv(in_features, base.block_k)
    split = 1
    target = _PROGRAMS_PER_SM * sms
    # A power of two that divides the K steps, so every split runs whole steps (no masked loads).
    while (
        tiles * split * 2 <= target and split * 2 <= _MAX_SPLIT_K
        and k_steps % (split * 2) == 0 and k_steps // (split * 2) >= _MIN_K_STEPS_PER_SPLIT
    ):
        split *= 2
    return GemmConfig(
        block_m=base.block_m, block_n=base.block_n, block_k=base.block_k,
        num_warps=base.num_warps, num_stages=base.num_stages, split_k=split,
    )


_DECODE_BF16 = tl.constexpr(DECODE_ASM["bf16"])
_DECODE_F16 = tl.constexpr(DECODE_ASM["f16"])


@triton.jit
def _decode_tile(packed, IS_FP16: tl.constexpr):
    """uint8 codes [BN, BK/2] → [BN, BK] 16-bit ``e2m1 · 2^bias`` (bf16: 2^120, f16: 2^8), in K order."""
    if IS_FP16:
        low, high = tl.inline_asm_elementwise(
            _DECODE_F16, "=r,=r,=r,=r,r", [packed], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    else:
        low, high = tl.inline_asm_elementwise(
            _DECODE_BF16, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
    return tl.reshape(tl.join(low, high), (packed.shape[0], packed.shape[1] * 2))


@triton.jit
def _scaled_tile(packed, scale_byte, IS_FP16: tl.constexpr):
    """Codes [BN, BK/2] and E4M3 scale bytes [BN, BK/16] → ``e2m1 · s_b`` [BN, BK] in bf16/f16, exact.

    The scale byte becomes a 16-bit float by a shift: bf16 ``s · 2^-120`` (<< 4), f16 ``s · 2^-8`` (<< 7), exact
    (E4M3 subnormals land on subnormals); its product with ``e2m1 · 2^120`` (``2^8``) is ``e2m1 · s_b``, exact.
    """
    if IS_FP16:
        scale = (scale_byte.to(tl.int16) << 7).to(tl.float16, bitcast=True)
    else:
        scale = (scale_byte.to(tl.int16) << 4).to(tl.bfloat16, bitcast=True)
    rows: tl.constexpr = packed.shape[0]
    cols: tl.constexpr = packed.shape[1] * 2
    weight = tl.reshape(_decode_tile(packed, IS_FP16), (rows, cols // 16, 16)) * scale[:, :, None]
    return tl.reshape(weight, (rows, cols))


@triton.jit
def _store_tile(acc, n, m, decode_scale_ptr, bias_ptr, out_ptr, out_features, rows, stride_out_row,
                HAS_BIAS: tl.constexpr):
    """out[m, n] = acc[n, m] · decode_scale (+ bias[n]), in the output dtype."""
    n_mask = n < out_features
    acc = acc * tl.load(decode_scale_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + m[None, :] * stride_out_row + n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (m[None, :] < rows))


@triton.jit
def _w4a16_kernel(
    x_ptr, weight_ptr, scales_ptr, decode_scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    rows, out_features, in_features, stride_x_row, stride_out_row, k_per_split,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IS_FP16: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    bytes_per_row = in_features // 2
    groups = in_features // 16
    byte = tl.arange(0, BLOCK_K // 2)
    group = tl.arange(0, BLOCK_K // 16)
    k_offsets = tl.arange(0, BLOCK_K)
    m_mask = m < rows
    # Rows past N read row N-1 (never stored): the weight loads need no row mask.
    n_rows = tl.minimum(n, out_features - 1)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_begin = split * k_per_split
    for step in range(0, k_per_split, BLOCK_K):
        k0 = k_begin + step
        byte_index = k0 // 2 + byte
        group_index = k0 // 16 + group
        weight_ptrs = weight_ptr + n_rows[:, None] * bytes_per_row + byte_index[None, :]
        scale_ptrs = scales_ptr + n_rows[:, None] * groups + group_index[None, :]
        if EVEN_K:
            packed = tl.load(weight_ptrs)
            scale_byte = tl.load(scale_ptrs)
        else:  # K is not a multiple of the split's steps: the last steps run past K and load zeros
            packed = tl.load(weight_ptrs, mask=byte_index[None, :] < bytes_per_row, other=0)
            scale_byte = tl.load(scale_ptrs, mask=group_index[None, :] < groups, other=0)
        weight = _scaled_tile(packed, scale_byte, IS_FP16)

        k_index = k0 + k_offsets
        x_mask = m_mask[None, :]
        if not EVEN_K:
            x_mask = x_mask & (k_index[:, None] < in_features)
        x_t = tl.load(x_ptr + m[None, :] * stride_x_row + k_index[:, None], mask=x_mask, other=0.0)
        acc = tl.dot(weight, x_t, acc)

    if SPLIT_K > 1:
        # Serial reduction in one launch: every split stores its partial tile, the last split of the tile to
        # arrive (an acq_rel counter) adds them in split order (deterministic) and resets the counter.
        tile = pid_m * tl.num_programs(0) + pid_n
        tile_partials = partial_ptr + tile * (SPLIT_K * BLOCK_N * BLOCK_M)
        local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tl.store(tile_partials + split * (BLOCK_N * BLOCK_M) + local, acc)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for other in tl.static_range(SPLIT_K):
                acc += tl.load(tile_partials + other * (BLOCK_N * BLOCK_M) + local, cache_modifier=".cg")
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
            _store_tile(acc, n, m, decode_scale_ptr, bias_ptr, out_ptr, out_features, rows, stride_out_row, HAS_BIAS)
    else:
        _store_tile(acc, n, m, decode_scale_ptr, bias_ptr, out_ptr, out_features, rows, stride_out_row, HAS_BIAS)


@triton.jit
def _scaled_weight_kernel(
    weight_ptr, scales_ptr, decode_scale_ptr, out_ptr, out_features, in_features,
    IS_FP16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """W [N, K] in x's dtype: ``e2m1 · s_b · decode_scale``, rounded once (the dense path's scratch weight)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    group = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    n_mask = n[:, None] < out_features
    packed = tl.load(weight_ptr + n[:, None] * (in_features // 2) + byte[None, :],
                     mask=n_mask & (byte[None, :] < in_features // 2), other=0)
    scale_byte = tl.load(scales_ptr + n[:, None] * (in_features // 16) + group[None, :],
                         mask=n_mask & (group[None, :] < in_features // 16), other=0)
    weight = _scaled_tile(packed, scale_byte, IS_FP16).to(tl.float32) * tl.load(decode_scale_ptr)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + n[:, None] * in_features + k[None, :], weight.to(out_ptr.dtype.element_ty),
             mask=n_mask & (k[None, :] < in_features))


def _dense_linear(x, weight, scales, decode_scale, bias):
    """Prefill sizes: dequantize W once into x's dtype (bf16), then one cuBLAS matmul."""
    out_features, in_features = weight.shape[0], x.shape[1]
    dense = torch.empty((out_features, in_features), dtype=x.dtype, device=x.device)
    block_n, block_k = 16, 256
    grid = (triton.cdiv(out_features, block_n), triton.cdiv(in_features, block_k))
    _scaled_weight_kernel[grid](
        weight, scales, decode_scale, dense, out_features, in_features,
        IS_FP16=x.dtype == torch.float16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    if bias is None:
        return torch.matmul(x, dense.T)
    return torch.addmm(bias, x, dense.T)


_gluon_failure: dict[str, str] = {}
"""Gluon kernels turned off in this process ("decode", "wgmma", "prefill") and why."""
_GLUON_FALLBACK = {
    "decode": "1..16 tokens use the tl kernel",
    "wgmma": "17..255 tokens use the tl kernel",
    "prefill": f"calls of {PREFILL_FROM_ROWS}+ tokens use the tl kernel (fp16) or dequantize + cuBLAS (bf16)",
}


def _disable_gluon(kernel: str, exc: BaseException) -> None:
    """Gluon is experimental in Triton and its API moves between releases: a failure turns that kernel off."""
    _gluon_failure[kernel] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    logger.warning(
        "NVFP4: the Gluon %s kernel failed on triton %s (%s); %s from now on",
        kernel, triton.__version__, _gluon_failure[kernel], _GLUON_FALLBACK[kernel],
    )


def select_config(
    rows: int, out_features: int, in_features: int, dtype: torch.dtype, device_index: int
) -> GemmConfig | GemvConfig | WgmmaConfig | PrefillConfig | None:
    """What ``w4a16_linear`` launches for x [rows, K] × W [N, K]: a Gluon kernel's config (decode kernel for 1..16
    tokens, wgmma kernel for 17..255 on Hopper, prefill kernel from 256 on Hopper for fp16, and for bf16 on large
    layers up to 512), the tl kernel's, or None for dequantize + cuBLAS (other bf16 prefill)."""
    prefill = (rows >= PREFILL_FROM_ROWS and "prefill" not in _gluon_failure
               and prefill_supported(in_features, device_index))
    if rows >= DENSE_FROM_ROWS and dtype == torch.bfloat16:
        if not (prefill and rows <= PREFILL_BF16[0] and out_features * in_features >= PREFILL_BF16[1]):
            return None
    sms = sm_count(device_index)
    if prefill:
        return pick_prefill_config(rows, out_features, sms)
    # The *_supported checks cover token count and K, so the picks below are never None.
    if "decode" not in _gluon_failure and gemv_supported(rows, in_features, device_index):
        return pick_gemv_config(rows, out_features, in_features, sms)
    if "wgmma" not in _gluon_failure and wgmma_supported(rows, in_features, device_index):
        return pick_wgmma_config(rows, out_features, in_features, sms)
    return pick_config(rows, out_features, in_features, sms)


def w4a16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    decode_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmConfig | GemvConfig | WgmmaConfig | PrefillConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` → [M, N] in x's dtype, on CUDA. ``config`` overrides the choice (benchmarks):
    a ``GemvConfig`` runs the Gluon decode kernel, a ``WgmmaConfig`` the Gluon wgmma kernel, a ``PrefillConfig``
    the Gluon prefill kernel, a ``GemmConfig`` the tl kernel."""
    check_gemm_inputs(x, weight, scales, decode_scale, bias)
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    scales = scales.contiguous().view(torch.uint8)
    decode_scale = decode_scale.reshape(())
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return out
    device_index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    chosen = config is None
    if chosen:
        config = select_config(rows, out_features, in_features, x.dtype, device_index)
        if config is None:
            return _dense_linear(x, weight, scales, decode_scale, bias)
    if isinstance(config, (GemvConfig, WgmmaConfig, PrefillConfig)):
        kernel = {GemvConfig: "decode", WgmmaConfig: "wgmma", PrefillConfig: "prefill"}[type(config)]
        try:
            if kernel == "decode":
                return gluon_gemv.w4a16_gemv(x, weight, scales, decode_scale, bias, out, config)
            if kernel == "wgmma":
                return gluon_gemv.w4a16_wgmma(x, weight, scales, decode_scale, bias, out, config)
            return gluon_gemv.w4a16_prefill(x, weight, scales, decode_scale, bias, out, config)
        except Exception as exc:  # noqa: BLE001 - a Triton whose Gluon does not compile this kernel
            if not chosen:
                raise
            _disable_gluon(kernel, exc)
            config = select_config(rows, out_features, in_features, x.dtype, device_index)
            if config is None:
                return _dense_linear(x, weight, scales, decode_scale, bias)
    grid_n, grid_m = triton.cdiv(out_features, config.block_n), triton.cdiv(rows, config.block_m)
    k_steps = triton.cdiv(in_features, config.block_k)
    k_per_split = triton.cdiv(k_steps, config.split_k) * config.block_k
    splits = triton.cdiv(in_features, k_per_split)
    counters = split_counters(x.device, grid_n * grid_m) if splits > 1 else None
    if counters is None:
        splits, k_per_split = 1, k_steps * config.block_k
        partials = counters = out  # any pointer: not read without a split
    else:
        partials = torch.empty(
            (grid_n * grid_m, splits, config.block_n, config.block_m), dtype=torch.float32, device=x.device
        )
    bias_arg = bias if bias is not None else decode_scale  # any pointer: not read without a bias
    _w4a16_kernel[(grid_n, grid_m, splits)](
        x, weight, scales, decode_scale, bias_arg, out, partials, counters,
        rows, out_features, in_features, x.stride(0), out_features, k_per_split,
        HAS_BIAS=bias is not None, SPLIT_K=splits, IS_FP16=x.dtype == torch.float16,
        EVEN_K=k_per_split * splits == in_features,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
