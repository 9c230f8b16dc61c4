"""Triton W4A16 GEMM: ``out = x @ W.T (+ bias)`` with W an NVFP4 weight, dequantized in registers.

Runs on sm_80+ (no FP4 hardware needed). The product is computed transposed, ``out.T = W · x.T``, so the
dequantized weight tile is the *first* dot operand: on Hopper wgmma reads that operand from registers, and the
weight never takes a round trip through shared memory. The activation tile is the second operand, for which
tl.dot needs at least 16 columns: decode (M < 16) pads the token block to 16 — the tensor cores have spare
capacity there, the kernel is bound by the weight bytes.

Weight decode: the packed weight is read as int32 words (8 codes each). A 4-bit code c becomes the float16 bit
pattern ``sign(c) << 15 | (c & 7) << 9``, whose value is exactly ``e2m1(c) · 2^-14`` (code 1 lands on the fp16
subnormal 2^-15); multiplied by the block scale in float16 (packed HMUL2) it gives ``e2m1 · s_b · 2^-14``, exact
in float16 (≤ 6 significant bits, a multiple of 2^-24) and in bf16. The 2^14 and the tensor decode scale multiply
the float32 accumulator once at the end. The decode is ALU work (~10 SASS instructions per weight element at
M ≤ 16 on sm_90, measured from the compiled loop): at decode sizes it, not HBM, is the likely limit.

Launch configuration comes from a fixed table keyed on M (``pick_config``), never from autotuning, so the first
call inside a CUDA-graph capture launches exactly what eager calls launch. For few output tiles (small M) the K
loop is split across programs (split-K) so every SM streams weights; partial sums go to a float32 workspace and
a second small kernel adds them (deterministic: no atomics).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import check_gemm_inputs
from .triton_quant import e4m3_decode


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


# (largest M, config with split_k=1): the first row whose bound is ≥ M is used.
_CONFIG_TABLE: tuple[tuple[int, GemmConfig], ...] = (
    (16, GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)),
    (32, GemmConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4)),
    (64, GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)),
    (128, GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)),
    (256, GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)),
    (1 << 62, GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)),
)
_MAX_SPLIT_K = 16
_MIN_K_STEPS_PER_SPLIT = 4
# Programs per SM to aim for when splitting K: the M ≤ 16 config (80 registers, 32 KB of shared memory at 4
# stages on sm_90) fits 6 per SM; 4 keeps every SM streaming weights without making the split-K sum large.
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
    if tiles < target:
        split = min(triton.cdiv(target, tiles), _MAX_SPLIT_K, max(1, k_steps // _MIN_K_STEPS_PER_SPLIT))
    return GemmConfig(
        block_m=base.block_m, block_n=base.block_n, block_k=base.block_k,
        num_warps=base.num_warps, num_stages=base.num_stages, split_k=max(split, 1),
    )


@triton.jit
def _nibble_value(words, index: tl.constexpr, word_scale):
    """Nibble ``index`` of each int32 word as ``e2m1 · s_b · 2^-14``, exact in float16 (see the module docstring)."""
    nibble = words >> (4 * index)
    pattern = ((nibble & 0x7) << 9) | ((nibble & 0x8) << 12)
    return pattern.to(tl.int16).to(tl.float16, bitcast=True) * word_scale


@triton.jit
def _w4a16_kernel(
    x_ptr, weight_ptr, scales_ptr, decode_scale_ptr, bias_ptr, out_ptr,
    rows, out_features, in_features, stride_x_row, stride_out_split, stride_out_row, k_per_split,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    words_per_row = in_features // 8
    groups = in_features // 16
    word = tl.arange(0, BLOCK_K // 8)
    group = tl.arange(0, BLOCK_K // 16)
    k_offsets = tl.arange(0, BLOCK_K)
    n_mask = n < out_features
    m_mask = m < rows

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_begin = split * k_per_split
    # The last split may run past K: masks zero those steps (all splits take the same time anyway).
    for step in range(0, k_per_split, BLOCK_K):
        k0 = k_begin + step
        word_index = k0 // 8 + word
        words = tl.load(
            weight_ptr + n[:, None] * words_per_row + word_index[None, :],
            mask=n_mask[:, None] & (word_index[None, :] < words_per_row), other=0,
        )
        group_index = k0 // 16 + group
        scale_byte = tl.load(
            scales_ptr + n[:, None] * groups + group_index[None, :],
            mask=n_mask[:, None] & (group_index[None, :] < groups), other=0,
        ).to(tl.int32)
        scale = e4m3_decode(scale_byte).to(tl.float16)  # exact: E4M3 values are float16 values
        # One scale per two words (16 elements).
        word_scale = tl.reshape(tl.join(scale, scale), (BLOCK_N, BLOCK_K // 8))
        # Nibble i of a word is element 8·word + i. Joining in bit-reversed pairs makes the flattened order
        # of the last three size-2 dims equal to i, so the final reshape needs no permutation.
        n0 = _nibble_value(words, 0, word_scale)
        n1 = _nibble_value(words, 1, word_scale)
        n2 = _nibble_value(words, 2, word_scale)
        n3 = _nibble_value(words, 3, word_scale)
        n4 = _nibble_value(words, 4, word_scale)
        n5 = _nibble_value(words, 5, word_scale)
        n6 = _nibble_value(words, 6, word_scale)
        n7 = _nibble_value(words, 7, word_scale)
        values = tl.join(
            tl.join(tl.join(n0, n4), tl.join(n2, n6)),
            tl.join(tl.join(n1, n5), tl.join(n3, n7)),
        )
        weight = tl.reshape(values, (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)

        k_index = k0 + k_offsets
        x_t = tl.load(
            x_ptr + m[None, :] * stride_x_row + k_index[:, None],
            mask=m_mask[None, :] & (k_index[:, None] < in_features), other=0.0,
        )
        acc = tl.dot(weight, x_t, acc)

    acc = acc * (tl.load(decode_scale_ptr) * 16384.0)  # 2^14 undoes the 2^-14 of the fp16 code patterns
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + split * stride_out_split + m[None, :] * stride_out_row + n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _split_k_sum_kernel(
    partial_ptr, bias_ptr, out_ptr, numel, out_features,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + split * numel + offsets, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offsets % out_features, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


def w4a16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    decode_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` → [M, N] in x's dtype, on CUDA. ``config`` overrides the table (benchmarks)."""
    check_gemm_inputs(x, weight, scales, decode_scale, bias)
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    if weight.storage_offset() % 4:
        weight = weight.clone()  # an int32 view needs 4-byte alignment
    weight = weight.view(torch.int32)  # 8 codes per word: [N, K/8]
    scales = scales.contiguous().view(torch.uint8)
    decode_scale = decode_scale.reshape(())
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return out
    if config is None:
        config = pick_config(rows, out_features, in_features, sm_count(x.device.index or 0))
    k_steps = triton.cdiv(in_features, config.block_k)
    k_per_split = triton.cdiv(k_steps, config.split_k) * config.block_k
    splits = triton.cdiv(in_features, k_per_split)
    target = out if splits == 1 else torch.empty((splits, rows, out_features), dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else decode_scale  # any pointer: not read without a bias
    grid = (triton.cdiv(out_features, config.block_n), triton.cdiv(rows, config.block_m), splits)
    _w4a16_kernel[grid](
        x, weight, scales, decode_scale, bias_arg, target,
        rows, out_features, in_features, x.stride(0), rows * out_features, out_features, k_per_split,
        HAS_BIAS=bias is not None and splits == 1,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        numel = rows * out_features
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(numel, block),)](
            target, bias_arg, out, numel, out_features,
            SPLIT_K=splits, HAS_BIAS=bias is not None, BLOCK=block,
        )
    return out
