"""Gluon W4A16 kernel for decode (M ≤ 16 tokens): mma.sync fed straight from 16-byte weight loads.

The product is computed transposed, ``out.T = W · x.T``, with ``mma.m16n8k16``: the weight is operand A (16
rows × 16 k per instruction), the tokens operand B (8 columns; 16 tokens take two). No shared memory, no
layout conversion: the K order inside the tensor cores is a free choice as long as A and B agree, so each
thread loads 16 *contiguous* bytes of a weight row (32 codes) and the matching 32 contiguous activations,
and the kernel maps them onto the fragment slots the thread owns:

- a warp covers 16·``ROW_TILES`` weight rows and one 128-code step of K at a time; lane ``4g + t`` holds rows
  ``g`` and ``g + 8`` of each 16-row tile, codes ``32t .. 32t + 31`` of the step;
- mma step ``s`` (0..7) takes the thread's codes ``4s .. 4s + 3``: in fragment slots ``2t, 2t+1`` (codes
  ``4s, 4s+1``, one byte) and ``2t+8, 2t+9`` (codes ``4s+2, 4s+3``, the next byte). The activations take the
  same permutation, so the sum over K is unchanged.

The weight keeps the public layout (``[N, K/2]`` bytes, linear E4M3 scales): nothing is repacked. The decode is
``ptx.DECODE_PAIRS_ASM`` (byte lookup tables, 14 instructions per 8 codes, each register already holding the
two codes of one byte as the fragment wants them), then one multiply by the block scale as in the Triton
kernel. Gluon's layouts are explicit, and every reshuffle between the load layout and the mma operand layout
is checked at compile time to be a register renaming (``convert_layout(..., assert_trivial=True)``).

The warps of a program split K (``WARPS_K``) and their partial tiles are summed at the end; the loop loads
step ``i + 1`` before it computes step ``i``. Needs Triton's Gluon (``triton.experimental.gluon``, Triton ≥ 3.5)
and sm_80+; ``AVAILABLE`` says whether it imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .ptx import DECODE_PAIRS_ASM, TABLE_WORDS

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    AVAILABLE = True
except ImportError:  # a Triton without Gluon: callers use the tl kernel
    AVAILABLE = False

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
    """128-code steps loaded per loop iteration (a power of two)."""


def pick_gemv_config(out_features: int, in_features: int, sms: int) -> GemvConfig | None:
    """A configuration for W [N, K], or None when K is not a multiple of 128 (then the tl kernel runs)."""
    if in_features % STEP:
        return None
    steps_total = in_features // STEP
    warps = 8
    while warps > 1 and steps_total % warps:
        warps //= 2
    return GemvConfig(warps_k=warps, row_tiles=1, steps=1)


if AVAILABLE:

    @gluon.constexpr_function
    def _bases(count, axis, first, rank=3):
        """``log2(count)`` basis vectors along ``axis``: first, 2·first, ..."""
        bases = []
        step = first
        while step < first * count:
            basis = [0] * rank
            basis[axis] = step
            bases.append(basis)
            step *= 2
        return bases

    @gluon.constexpr_function
    def _weight_layout(warps_k, row_tiles, steps):
        """Packed weight bytes [WK, 16·RT, 64·steps]: 16 contiguous bytes per row, rows g and g+8 per lane."""
        return gl.DistributedLinearLayout(
            reg_bases=_bases(16, 2, 1) + [[0, 8, 0]] + _bases(row_tiles, 1, 16) + _bases(steps, 2, 64),
            lane_bases=[[0, 0, 16], [0, 0, 32], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
            warp_bases=_bases(warps_k, 0, 1), block_bases=[], shape=[warps_k, 16 * row_tiles, 64 * steps],
        )

    @gluon.constexpr_function
    def _scale_layout(warps_k, row_tiles, steps):
        """Scale bytes [WK, 16·RT, 8·steps]: the two blocks of the lane's 32 codes, per row."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 8, 0]] + _bases(row_tiles, 1, 16) + _bases(steps, 2, 8),
            lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
            warp_bases=_bases(warps_k, 0, 1), block_bases=[], shape=[warps_k, 16 * row_tiles, 8 * steps],
        )

    @gluon.constexpr_function
    def _x_layout(warps_k, block_m, steps):
        """Activations [WK, BM, 128·steps]: 32 contiguous values per token, tokens g and g+8 per lane."""
        return gl.DistributedLinearLayout(
            reg_bases=_bases(32, 2, 1) + _bases(block_m // 8, 1, 8) + _bases(steps, 2, 128),
            lane_bases=[[0, 0, 32], [0, 0, 64], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
            warp_bases=_bases(warps_k, 0, 1), block_bases=[], shape=[warps_k, block_m, 128 * steps],
        )

    @gluon.jit
    def _operands(packed, scale_byte, xv, tables, DECODE: gl.constexpr, IS_FP16: gl.constexpr, A_LAYOUT: gl.constexpr,
                  B_LAYOUT: gl.constexpr):
        """Loaded bytes, scale bytes and activations → (A, B) in the mma operand layouts, both in slot order."""
        WK: gl.constexpr = packed.shape[0]
        R: gl.constexpr = packed.shape[1]
        S: gl.constexpr = packed.shape[2] // 64
        BM: gl.constexpr = xv.shape[1]
        if IS_FP16:
            low, high = gl.inline_asm_elementwise(DECODE, "=r,=r,=r,=r,r" + ",r" * 12, [packed, tables[0], tables[1], tables[2]],
                                                  dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
            scale = (scale_byte.to(gl.int16) << 7).to(gl.float16, bitcast=True)
        else:
            low, high = gl.inline_asm_elementwise(DECODE, "=r,=r,=r,=r,r" + ",r" * 12, [packed, tables[0], tables[1], tables[2]],
                                                  dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
            scale = (scale_byte.to(gl.int16) << 4).to(gl.bfloat16, bitcast=True)
        # Byte p = 64d + 16t + 4i + e of a row, as 4 bytes per asm call: `low` holds codes 8i + e of the lane's
        # 32 and `high` codes 8i + 4 + e (see DECODE_PAIRS_ASM), so code 32t + 8i + 4h + e sits at (p, h).
        codes = gl.join(low, high)
        # Dims: WK, R, d, t, i_hi, i_lo, e_hi, e_lo, h. Scale block of the code: 2t + i_hi.
        codes = gl.reshape(codes, [WK, R, S, 4, 2, 2, 2, 2, 2])
        L8: gl.constexpr = gl.SliceLayout(8, codes.type.layout)
        L7: gl.constexpr = gl.SliceLayout(7, L8)
        L6: gl.constexpr = gl.SliceLayout(6, L7)
        L5: gl.constexpr = gl.SliceLayout(5, L6)
        scale = gl.convert_layout(gl.reshape(scale, [WK, R, S, 4, 2]), L5)
        scale = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(scale, 5), 6), 7), 8)
        codes = codes * scale
        # Code 4s + 2e_hi + e_lo of the lane (s = 2i + h = 4i_hi + 2i_lo + h) goes to mma step s, fragment slot
        # 8e_hi + 2t + e_lo.
        a = gl.permute(codes, [0, 1, 2, 4, 5, 8, 6, 3, 7])
        a = gl.convert_layout(gl.reshape(a, [WK, R, 128 * S]), A_LAYOUT, assert_trivial=True)
        # Activations: k = 32t + 4s + 2e_hi + e_lo → the same slot.
        b = gl.reshape(xv, [WK, BM, S, 4, 8, 2, 2])
        b = gl.permute(b, [0, 1, 2, 4, 5, 3, 6])
        b = gl.permute(gl.reshape(b, [WK, BM, 128 * S]), [0, 2, 1])
        b = gl.convert_layout(b, B_LAYOUT, assert_trivial=True)
        return a, b

    @gluon.jit
    def _gemv_kernel(
        x_ptr, weight_ptr, scales_ptr, decode_scale_ptr, bias_ptr, out_ptr,
        rows, out_features, row_bytes, row_groups, stride_x_row, stride_out_row, warp_bytes, warp_groups,
        TABLE_0: gl.constexpr, TABLE_1: gl.constexpr, TABLE_2: gl.constexpr,
        ITERATIONS: gl.constexpr, HAS_BIAS: gl.constexpr, IS_FP16: gl.constexpr, DECODE: gl.constexpr, BLOCK_M: gl.constexpr,
        WARPS_K: gl.constexpr, ROW_TILES: gl.constexpr, STEPS: gl.constexpr,
    ):
        R: gl.constexpr = 16 * ROW_TILES
        P_LAYOUT: gl.constexpr = _weight_layout(WARPS_K, ROW_TILES, STEPS)
        S_LAYOUT: gl.constexpr = _scale_layout(WARPS_K, ROW_TILES, STEPS)
        X_LAYOUT: gl.constexpr = _x_layout(WARPS_K, BLOCK_M, STEPS)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS_K, 1, 1],
                                                      instr_shape=[1, 16, 8])
        A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)

        row0 = gl.program_id(0) * R
        # Weight bytes: rows past N read row N-1 (never stored).
        pw = gl.arange(0, WARPS_K, layout=gl.SliceLayout(1, gl.SliceLayout(2, P_LAYOUT)))
        pr = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, P_LAYOUT)))
        pc = gl.arange(0, 64 * STEPS, layout=gl.SliceLayout(0, gl.SliceLayout(1, P_LAYOUT)))
        prow = gl.minimum(row0 + pr, out_features - 1)
        weight_ptrs = (weight_ptr + prow[None, :, None] * row_bytes + pw[:, None, None] * warp_bytes
                       + pc[None, None, :])
        sw = gl.arange(0, WARPS_K, layout=gl.SliceLayout(1, gl.SliceLayout(2, S_LAYOUT)))
        sr = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, S_LAYOUT)))
        sc = gl.arange(0, 8 * STEPS, layout=gl.SliceLayout(0, gl.SliceLayout(1, S_LAYOUT)))
        srow = gl.minimum(row0 + sr, out_features - 1)
        scale_ptrs = (scales_ptr + srow[None, :, None] * row_groups + sw[:, None, None] * warp_groups
                      + sc[None, None, :])
        xw = gl.arange(0, WARPS_K, layout=gl.SliceLayout(1, gl.SliceLayout(2, X_LAYOUT)))
        xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(2, X_LAYOUT)))
        xk = gl.arange(0, 128 * STEPS, layout=gl.SliceLayout(0, gl.SliceLayout(1, X_LAYOUT)))
        x_ptrs = x_ptr + xm[None, :, None] * stride_x_row + xw[:, None, None] * (2 * warp_bytes) + xk[None, None, :]
        x_mask = (xm < rows)[None, :, None] & (xk < 128 * STEPS)[None, None, :]

        # The decode tables' first words, as values ptxas cannot fold (prow < 2^30), so each stays in a register.
        opaque_zero = (prow >> 30)[None, :, None] + gl.zeros([WARPS_K, R, 64 * STEPS], gl.int32, layout=P_LAYOUT)
        tables = (opaque_zero | TABLE_0, opaque_zero | TABLE_1, opaque_zero | TABLE_2)
        acc = gl.zeros([WARPS_K, R, BLOCK_M], gl.float32, layout=MMA)
        # Unrolled (ITERATIONS is a compile-time constant): the loads of iteration i + 1 are issued before the
        # math of iteration i, and no loaded byte is carried through a loop (that would repack bytes).
        packed = gl.load(weight_ptrs)
        scale_byte = gl.load(scale_ptrs)
        xv = gl.load(x_ptrs, mask=x_mask, other=0.0)
        for it in gl.static_range(ITERATIONS):
            if it + 1 < ITERATIONS:
                next_packed = gl.load(weight_ptrs + (it + 1) * (64 * STEPS))
                next_scale = gl.load(scale_ptrs + (it + 1) * (8 * STEPS))
                next_x = gl.load(x_ptrs + (it + 1) * (128 * STEPS), mask=x_mask, other=0.0)
            a, b = _operands(packed, scale_byte, xv, tables, DECODE, IS_FP16, A_LAYOUT, B_LAYOUT)
            acc = mma_v2(a, b, acc)
            if it + 1 < ITERATIONS:
                packed = next_packed
                scale_byte = next_scale
                xv = next_x

        OUT_LAYOUT: gl.constexpr = gl.SliceLayout(0, MMA)
        total = gl.sum(acc, axis=0) * gl.load(decode_scale_ptr)
        n = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, OUT_LAYOUT))
        m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, OUT_LAYOUT))
        n_mask = n < out_features
        if HAS_BIAS:
            total += gl.load(bias_ptr + n, mask=n_mask, other=0.0).to(gl.float32)[:, None]
        out = out_ptr + m[None, :] * stride_out_row + n[:, None]
        gl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (m < rows)[None, :])


def gemv_supported(x: torch.Tensor, out_features: int) -> bool:
    """Whether the Gluon kernel takes this call (tokens ≤ 16, K a multiple of 128, sm_80+)."""
    return (
        AVAILABLE and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] % STEP == 0 and out_features > 0
        and torch.cuda.get_device_capability(x.device)[0] >= 8
    )


def w4a16_gemv(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, decode_scale: torch.Tensor,
    bias: torch.Tensor | None, out: torch.Tensor, config: GemvConfig,
) -> torch.Tensor:
    """``out = x @ W.T (+ bias)`` for checked, contiguous operands (``scales`` as uint8); returns ``out``."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    warp_codes = in_features // config.warps_k
    iterations = warp_codes // (STEP * config.steps)
    if warp_codes % (STEP * config.steps):
        raise ValueError(f"K={in_features} does not split into {config.warps_k} warps × {config.steps} steps of {STEP}")
    is_fp16 = x.dtype == torch.float16
    grid = (triton.cdiv(out_features, 16 * config.row_tiles),)
    _gemv_kernel[grid](
        x, weight, scales, decode_scale, bias if bias is not None else decode_scale, out,
        rows, out_features, in_features // 2, in_features // 16, x.stride(0), out.stride(0), warp_codes // 2, warp_codes // 16,
        *TABLE_WORDS["f16" if is_fp16 else "bf16"], ITERATIONS=iterations, HAS_BIAS=bias is not None, IS_FP16=is_fp16, DECODE=DECODE_PAIRS_ASM["f16" if is_fp16 else "bf16"],
        BLOCK_M=8 if rows <= 8 else 16, WARPS_K=config.warps_k, ROW_TILES=config.row_tiles, STEPS=config.steps,
        num_warps=config.warps_k,
    )
    return out
