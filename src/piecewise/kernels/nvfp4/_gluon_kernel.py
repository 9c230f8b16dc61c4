"""The Gluon decode kernel itself (see ``gluon_gemv``); imported only where Gluon imports and defines it."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


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
def _word_layout(warps_k, row_tiles, steps):
    """Packed weight as int32 words [WK, 16·RT, 16·steps]: 4 contiguous words (16 bytes) per row, rows g, g+8."""
    return gl.DistributedLinearLayout(
        reg_bases=_bases(4, 2, 1) + [[0, 8, 0]] + _bases(row_tiles, 1, 16) + _bases(steps, 2, 16),
        lane_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=_bases(warps_k, 0, 1), block_bases=[], shape=[warps_k, 16 * row_tiles, 16 * steps],
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
def _decoded_codes(words, DECODE: gl.constexpr, IS_FP16: gl.constexpr):
    """Weight words [..., Q] → 16-bit codes [..., Q, 2, 2, 2]. Word q = 16d + 4t + i of a row holds the lane's
    codes 8i .. 8i + 7; code 8i + c sits at (q, c0, c1, c2) with c = c0 + 2·c1 + 4·c2. Codes c and c + 4 share a
    register (DECODE_SHIFT_ASM)."""
    if IS_FP16:
        c0, c1, c2, c3, c4, c5, c6, c7 = gl.inline_asm_elementwise(
            DECODE, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    else:
        c0, c1, c2, c3, c4, c5, c6, c7 = gl.inline_asm_elementwise(
            DECODE, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
    return gl.join(gl.join(gl.join(c0, c1), gl.join(c2, c3)), gl.join(gl.join(c4, c5), gl.join(c6, c7)))


@gluon.jit
def _operands(words, scale, xv, DECODE: gl.constexpr, IS_FP16: gl.constexpr, A_LAYOUT: gl.constexpr,
              B_LAYOUT: gl.constexpr):
    """Weight words, block scales (16-bit floats, see ``_block_scales``) and activations → (A, B) in the mma
    operand layouts, both in slot order."""
    WK: gl.constexpr = words.shape[0]
    R: gl.constexpr = words.shape[1]
    S: gl.constexpr = words.shape[2] // 16
    BM: gl.constexpr = xv.shape[1]
    codes = _decoded_codes(words, DECODE, IS_FP16)
    # Dims: WK, R, d, t, i_hi, i_lo, c0, c1, c2. Scale block of the code: 2t + i_hi.
    codes = gl.reshape(codes, [WK, R, S, 4, 2, 2, 2, 2, 2])
    L8: gl.constexpr = gl.SliceLayout(8, codes.type.layout)
    L7: gl.constexpr = gl.SliceLayout(7, L8)
    L6: gl.constexpr = gl.SliceLayout(6, L7)
    L5: gl.constexpr = gl.SliceLayout(5, L6)
    scale = gl.convert_layout(gl.reshape(scale, [WK, R, S, 4, 2]), L5)
    scale = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(scale, 5), 6), 7), 8)
    if IS_FP16:
        codes = codes * 16384.0  # e2m1 · 2^-14 → e2m1, exact
    codes = codes * scale
    # Lane code 8i + c0 + 2c1 + 4c2 goes to mma step s = 2i + c1 (= 4i_hi + 2i_lo + c1), fragment slot
    # 8c0 + 2t + c2: the two codes of a register (c2 = 0, 1) fill the slot pair (2t, 2t + 1) or (2t + 8, 2t + 9).
    a = gl.permute(codes, [0, 1, 2, 4, 5, 7, 6, 3, 8])
    a = gl.convert_layout(gl.reshape(a, [WK, R, 128 * S]), A_LAYOUT, assert_trivial=True)
    # Activations: lane k = 8i + 4c2 + 2c1 + c0 → the same slot (pairs 4 apart: a register shuffle).
    b = gl.reshape(xv, [WK, BM, S, 4, 2, 2, 2, 2, 2])  # dims: WK, BM, d, t, i_hi, i_lo, c2, c1, c0
    b = gl.permute(b, [0, 1, 2, 4, 5, 7, 8, 3, 6])
    b = gl.permute(gl.reshape(b, [WK, BM, 128 * S]), [0, 2, 1])
    b = gl.convert_layout(b, B_LAYOUT)
    return a, b


@gluon.jit
def _shifted_scales(scale_byte, IS_FP16: gl.constexpr):
    """E4M3 bytes shifted into a 16-bit float's exponent and mantissa: exactly ``s · 2^-8`` (f16) / ``s · 2^-120``
    (bf16), E4M3 subnormals included."""
    if IS_FP16:
        scale = (scale_byte.to(gl.int16) << 7).to(gl.float16, bitcast=True)
    else:
        scale = (scale_byte.to(gl.int16) << 4).to(gl.bfloat16, bitcast=True)
    return scale


@gluon.jit
def _block_scales(scale_byte, IS_FP16: gl.constexpr):
    """E4M3 bytes → the 16-bit factor that turns the decoded codes into ``e2m1 · s_b`` (f16) or ``e2m1 · s_b · 2^-8``
    (bf16; the kernel multiplies its float32 result by 2^8). Exact: ``_shifted_scales``, then multiplies by
    powers of two that stay in range."""
    scale = _shifted_scales(scale_byte, IS_FP16)
    if IS_FP16:
        scale = scale * 256.0
    else:
        scale = (scale * 1.7014118346046923e38) * 2.5961484292674138e33  # · 2^127 · 2^111 = s · 2^118
    return scale


@gluon.jit
def _load_weights(weight_ptrs, scale_ptrs, first_w, last_w, first_s, last_s, it, STEPS: gl.constexpr):
    """The words and scale bytes of each warp's iteration ``it``, clamped to the warp's last one (prefetches past
    the end, and a warp's empty tail when the steps do not split evenly, re-read it)."""
    word_step = gl.minimum(first_w + it, last_w)[:, None, None]
    scale_step = gl.minimum(first_s + it, last_s)[:, None, None]
    return gl.load(weight_ptrs + word_step * (16 * STEPS)), gl.load(scale_ptrs + scale_step * (8 * STEPS))


@gluon.jit
def _gemv_kernel(
    x_ptr, weight_ptr, scales_ptr, decode_scale_ptr, bias_ptr, out_ptr,
    rows, out_features, row_bytes, row_groups, stride_x_row, stride_out_row, iterations, total_iterations,
    HAS_BIAS: gl.constexpr, IS_FP16: gl.constexpr, DECODE: gl.constexpr, BLOCK_M: gl.constexpr,
    WARPS_K: gl.constexpr, ROW_TILES: gl.constexpr, STEPS: gl.constexpr, PREFETCH: gl.constexpr, EVEN: gl.constexpr,
):
    R: gl.constexpr = 16 * ROW_TILES
    P_LAYOUT: gl.constexpr = _word_layout(WARPS_K, ROW_TILES, STEPS)
    S_LAYOUT: gl.constexpr = _scale_layout(WARPS_K, ROW_TILES, STEPS)
    X_LAYOUT: gl.constexpr = _x_layout(WARPS_K, BLOCK_M, STEPS)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS_K, 1, 1],
                                                  instr_shape=[1, 16, 8])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)

    row0 = gl.program_id(0) * R
    # Weight words and scale bytes: rows past N read row N-1 (never stored).
    pw = gl.arange(0, WARPS_K, layout=gl.SliceLayout(1, gl.SliceLayout(2, P_LAYOUT)))
    pr = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, P_LAYOUT)))
    pc = gl.arange(0, 16 * STEPS, layout=gl.SliceLayout(0, gl.SliceLayout(1, P_LAYOUT)))
    prow = gl.minimum(row0 + pr, out_features - 1)
    weight_ptrs = (weight_ptr.to(gl.pointer_type(gl.int32)) + prow[None, :, None] * (row_bytes // 4)
                   + pc[None, None, :])
    sw = gl.arange(0, WARPS_K, layout=gl.SliceLayout(1, gl.SliceLayout(2, S_LAYOUT)))
    sr = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, S_LAYOUT)))
    sc = gl.arange(0, 8 * STEPS, layout=gl.SliceLayout(0, gl.SliceLayout(1, S_LAYOUT)))
    srow = gl.minimum(row0 + sr, out_features - 1)
    scale_ptrs = scales_ptr + srow[None, :, None] * row_groups + sc[None, None, :]
    xw = gl.arange(0, WARPS_K, layout=gl.SliceLayout(1, gl.SliceLayout(2, X_LAYOUT)))
    xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(2, X_LAYOUT)))
    xk = gl.arange(0, 128 * STEPS, layout=gl.SliceLayout(0, gl.SliceLayout(1, X_LAYOUT)))
    x_ptrs = x_ptr + xm[None, :, None] * stride_x_row + xk[None, None, :]
    x_mask = (xm < rows)[None, :, None] & (xk < 128 * STEPS)[None, None, :]  # second term: broadcast only
    # Warp w takes iterations w·iterations .. (w + 1)·iterations - 1 of the total_iterations of K. When they do
    # not split evenly (not EVEN), the last warps' surplus iterations re-read their last weight words and load
    # zero activations, so they add nothing.
    first_w = pw * iterations
    last_w = gl.minimum(first_w + iterations, total_iterations) - 1
    first_s = sw * iterations
    last_s = gl.minimum(first_s + iterations, total_iterations) - 1
    first_x = xw * iterations

    acc = gl.zeros([WARPS_K, R, BLOCK_M], gl.float32, layout=MMA)
    # The weight words of iteration i + 1 (and i + 2 with PREFETCH = 2) are loaded before the math of
    # iteration i and carried through the loop as 32-bit words, so they are in flight during it. The last
    # iterations re-load the final step instead of reading past the warp's share of K.
    w_next = _load_weights(weight_ptrs, scale_ptrs, first_w, last_w, first_s, last_s, 0, STEPS)
    if PREFETCH > 1:
        w_after = _load_weights(weight_ptrs, scale_ptrs, first_w, last_w, first_s, last_s, 1, STEPS)
    for it in range(iterations):
        current = w_next
        if PREFETCH > 1:
            w_next = w_after
            w_after = _load_weights(weight_ptrs, scale_ptrs, first_w, last_w, first_s, last_s, it + 2, STEPS)
        else:
            w_next = _load_weights(weight_ptrs, scale_ptrs, first_w, last_w, first_s, last_s, it + 1, STEPS)
        x_step = (first_x + it)[:, None, None]
        if EVEN:
            xv = gl.load(x_ptrs + x_step * (128 * STEPS), mask=x_mask, other=0.0)
        else:
            xv = gl.load(x_ptrs + x_step * (128 * STEPS), mask=x_mask & (x_step < total_iterations), other=0.0)
        a, b = _operands(current[0], _block_scales(current[1], IS_FP16), xv, DECODE, IS_FP16, A_LAYOUT, B_LAYOUT)
        acc = mma_v2(a, b, acc)

    OUT_LAYOUT: gl.constexpr = gl.SliceLayout(0, MMA)
    total = gl.sum(acc, axis=0) * gl.load(decode_scale_ptr)
    if not IS_FP16:
        total = total * 256.0  # the bf16 operands carry 2^-8 (_block_scales)
    n = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, OUT_LAYOUT))
    m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, OUT_LAYOUT))
    n_mask = n < out_features
    if HAS_BIAS:
        total += gl.load(bias_ptr + n, mask=n_mask, other=0.0).to(gl.float32)[:, None]
    out = out_ptr + m[None, :] * stride_out_row + n[:, None]
    gl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (m < rows)[None, :])
