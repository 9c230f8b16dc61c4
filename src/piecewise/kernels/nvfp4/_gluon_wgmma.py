"""Gluon W4A16 kernel for 17..255 tokens on Hopper: the decoded weight as wgmma's register operand.

``out.T = W · x.T`` per program: 16·``WARPS`` weight rows (one 16-row slice per warp, so one or two
warpgroups) × ``BLOCK_M`` tokens, 128·``STEPS`` codes of K per iteration. The weight words are loaded
straight into registers with the decode kernel's layout (each lane 16 contiguous bytes of a row) and decoded
by the same shifts and masks; the operand-A layout they end in is checked at compile time to be a register
renaming. The activations take the matching K permutation in registers on their way into shared memory
(two buffers), where wgmma reads them as operand B. The wgmma runs asynchronously: while it runs, the warps
store the next activations, decode the next weights and have the loads after that in flight. Where the
programs would be too few to fill the GPU, K is split over ``split_k`` programs (grid axis 2): each stores its
float32 tile and the last of a tile's programs to finish adds them in split order (``splitk``).

Host side and configuration: ``gluon_gemv`` (``WgmmaConfig``, ``pick_wgmma_config``, ``w4a16_wgmma``).
Imported only where Gluon imports and defines it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ._gluon_compat import cta_barrier
from ._gluon_kernel import _bases, _block_scales, _decoded_codes


@gluon.constexpr_function
def _row_words_layout(warps, steps):
    """Packed weight as int32 words [16·warps, 16·steps]: per lane 4 contiguous words (16 bytes) of rows g and
    g + 8; warp w owns rows 16w .. 16w + 15 (wgmma's operand-A rows)."""
    return gl.DistributedLinearLayout(
        reg_bases=_bases(4, 1, 1, rank=2) + [[8, 0]] + _bases(steps, 1, 16, rank=2),
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=_bases(warps, 0, 16, rank=2), block_bases=[], shape=[16 * warps, 16 * steps],
    )


@gluon.constexpr_function
def _row_scales_layout(warps, steps):
    """Scale bytes [16·warps, 8·steps]: the two blocks of the lane's 32 codes, rows g and g + 8."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0]] + _bases(steps, 1, 8, rank=2),
        lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=_bases(warps, 0, 16, rank=2), block_bases=[], shape=[16 * warps, 8 * steps],
    )


@gluon.jit
def _weight_operand(words, scale, DECODE: gl.constexpr, IS_FP16: gl.constexpr, A_LAYOUT: gl.constexpr):
    """Weight words [R, 16·S] and block scales [R, 8·S] → operand A [R, 128·S] in slot order (see
    ``_gluon_kernel._operands``: the same code-to-slot map, with the warps on the rows)."""
    R: gl.constexpr = words.shape[0]
    S: gl.constexpr = words.shape[1] // 16
    codes = _decoded_codes(words, DECODE, IS_FP16)
    # Dims: R, d, t, i_hi, i_lo, c0, c1, c2. Scale block of the code: 2t + i_hi.
    codes = gl.reshape(codes, [R, S, 4, 2, 2, 2, 2, 2])
    L7: gl.constexpr = gl.SliceLayout(7, codes.type.layout)
    L6: gl.constexpr = gl.SliceLayout(6, L7)
    L5: gl.constexpr = gl.SliceLayout(5, L6)
    L4: gl.constexpr = gl.SliceLayout(4, L5)
    scale = gl.convert_layout(gl.reshape(scale, [R, S, 4, 2]), L4)
    scale = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(scale, 4), 5), 6), 7)
    if IS_FP16:
        codes = codes * 16384.0  # e2m1 · 2^-14 → e2m1, exact
    codes = codes * scale
    a = gl.permute(codes, [0, 1, 3, 4, 6, 5, 2, 7])
    return gl.convert_layout(gl.reshape(a, [R, 128 * S]), A_LAYOUT, assert_trivial=True)


@gluon.jit
def _slot_order(xv):
    """Activations [BM, 128·S] in memory order → the slot order of the weight operand (per 128 codes: physical
    k = 32t + 8i + 4c2 + 2c1 + c0 goes to 16(2i + c1) + 8c0 + 2t + c2)."""
    BM: gl.constexpr = xv.shape[0]
    S: gl.constexpr = xv.shape[1] // 128
    xv = gl.reshape(xv, [BM, S, 4, 4, 2, 2, 2])
    return gl.reshape(gl.permute(xv, [0, 1, 3, 5, 6, 2, 4]), [BM, 128 * S])


@gluon.jit
def _wgmma_kernel(
    x_ptr, weight_ptr, scales_ptr, decode_scale_ptr, bias_ptr, out_ptr,
    rows, out_features, row_bytes, row_groups, stride_x_row, stride_out_row, iterations,
    partial_ptr, counter_ptr, split_k,
    HAS_BIAS: gl.constexpr, IS_FP16: gl.constexpr, DECODE: gl.constexpr, BLOCK_M: gl.constexpr,
    WARPS: gl.constexpr, STEPS: gl.constexpr, SPLIT: gl.constexpr,
):
    # out.T [R, BM] += W [R, 128·S] · x.T [128·S, BM] per iteration. Rows past N read row N-1, tokens past M
    # are zeros; neither is stored. With SPLIT, program_id(2) takes iterations split·iterations ..
    # (split + 1)·iterations - 1 of K, stores its float32 tile in ``partial_ptr``, and the last of the tile's
    # ``split_k`` programs to arrive (an acq_rel counter) adds the tiles in split order (deterministic) and stores.
    R: gl.constexpr = 16 * WARPS
    BK: gl.constexpr = 128 * STEPS
    P_LAYOUT: gl.constexpr = _row_words_layout(WARPS, STEPS)
    S_LAYOUT: gl.constexpr = _row_scales_layout(WARPS, STEPS)
    X_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    X_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    row0 = gl.program_id(0) * R
    m0 = gl.program_id(1) * BLOCK_M
    pr = gl.arange(0, R, layout=gl.SliceLayout(1, P_LAYOUT))
    pc = gl.arange(0, 16 * STEPS, layout=gl.SliceLayout(0, P_LAYOUT))
    prow = gl.minimum(row0 + pr, out_features - 1)
    weight_ptrs = weight_ptr.to(gl.pointer_type(gl.int32)) + prow[:, None] * (row_bytes // 4) + pc[None, :]
    sr = gl.arange(0, R, layout=gl.SliceLayout(1, S_LAYOUT))
    sc = gl.arange(0, 8 * STEPS, layout=gl.SliceLayout(0, S_LAYOUT))
    srow = gl.minimum(row0 + sr, out_features - 1)
    scale_ptrs = scales_ptr + srow[:, None] * row_groups + sc[None, :]
    xm = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_LAYOUT))
    xk = gl.arange(0, BK, layout=gl.SliceLayout(0, X_LAYOUT))
    x_ptrs = x_ptr + xm[:, None] * stride_x_row + xk[None, :]
    x_mask = (xm < rows)[:, None] & (xk < BK)[None, :]
    if SPLIT:
        first = gl.program_id(2) * iterations
        weight_ptrs += first * (16 * STEPS)
        scale_ptrs += first * (8 * STEPS)
        x_ptrs += first * BK

    x_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [2, BLOCK_M, BK], X_SMEM)
    # Software pipeline: while the wgmma of iteration i runs (asynchronously, its operand A in registers),
    # the warps store iteration i + 1's activations into the other buffer and decode its weights; the loads
    # of iteration i + 2 are in flight. The previous operand A stays live until its wgmma has completed.
    words = gl.load(weight_ptrs)
    scale_byte = gl.load(scale_ptrs)
    xv = gl.load(x_ptrs, mask=x_mask, other=0.0)
    last = iterations - 1
    w_next = gl.load(weight_ptrs + gl.minimum(1, last) * (16 * STEPS))
    s_next = gl.load(scale_ptrs + gl.minimum(1, last) * (8 * STEPS))
    x_next = gl.load(x_ptrs + gl.minimum(1, last) * BK, mask=x_mask, other=0.0)
    x_smem.index(0).store(_slot_order(xv))
    fence_async_shared()
    cta_barrier()
    a_prev = _weight_operand(words, _block_scales(scale_byte, IS_FP16), DECODE, IS_FP16, A_LAYOUT)
    token = warpgroup_mma(a_prev, x_smem.index(0).permute((1, 0)), gl.zeros([R, BLOCK_M], gl.float32, layout=MMA),
                          is_async=True)
    x_smem.index(1).store(_slot_order(x_next))
    fence_async_shared()
    for it in range(1, iterations):
        words = w_next
        scale_byte = s_next
        step = gl.minimum(it + 1, last)
        w_next = gl.load(weight_ptrs + step * (16 * STEPS))
        s_next = gl.load(scale_ptrs + step * (8 * STEPS))
        x_next = gl.load(x_ptrs + step * BK, mask=x_mask, other=0.0)
        a = _weight_operand(words, _block_scales(scale_byte, IS_FP16), DECODE, IS_FP16, A_LAYOUT)
        acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=[token, a_prev])
        # Every warpgroup's wgmma i - 1 is done: its buffer may be written once this one's wgmma is issued.
        cta_barrier()
        token = warpgroup_mma(a, x_smem.index(it % 2).permute((1, 0)), acc, is_async=True)
        x_smem.index((it + 1) % 2).store(_slot_order(x_next))
        fence_async_shared()
        a_prev = a
    acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=[token, a_prev])
    if SPLIT:
        tile = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        tile_partials = partial_ptr + tile * (split_k * R * BLOCK_M)
        local = gl.arange(0, R, layout=gl.SliceLayout(1, MMA))[:, None] * BLOCK_M + gl.arange(
            0, BLOCK_M, layout=gl.SliceLayout(0, MMA))[None, :]
        gl.store(tile_partials + gl.program_id(2) * (R * BLOCK_M) + local, acc)
        cta_barrier()  # every thread's partial is written before the release below
        arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            acc = gl.zeros([R, BLOCK_M], gl.float32, layout=MMA)
            for other in range(split_k):
                acc += gl.load(tile_partials + other * (R * BLOCK_M) + local, cache_modifier=".cg")
            gl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
            _store_tile(acc, row0, m0, rows, out_features, decode_scale_ptr, bias_ptr, out_ptr, stride_out_row,
                        HAS_BIAS, IS_FP16, MMA)
    else:
        _store_tile(acc, row0, m0, rows, out_features, decode_scale_ptr, bias_ptr, out_ptr, stride_out_row,
                    HAS_BIAS, IS_FP16, MMA)


@gluon.jit
def _store_tile(acc, row0, m0, rows, out_features, decode_scale_ptr, bias_ptr, out_ptr, stride_out_row,
                HAS_BIAS: gl.constexpr, IS_FP16: gl.constexpr, MMA: gl.constexpr):
    """out[m0 + j, row0 + i] = acc[i, j] · decode scale (+ bias), for the real rows and tokens."""
    R: gl.constexpr = acc.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    scale = gl.load(decode_scale_ptr)
    if not IS_FP16:
        scale = scale * 256.0  # the bf16 operands carry 2^-8 (_block_scales)
    total = acc * scale
    n = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, MMA))
    m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    n_mask = n < out_features
    if HAS_BIAS:
        total += gl.load(bias_ptr + n, mask=n_mask, other=0.0).to(gl.float32)[:, None]
    out = out_ptr + m[None, :] * stride_out_row + n[:, None]
    gl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (m < rows)[None, :])
