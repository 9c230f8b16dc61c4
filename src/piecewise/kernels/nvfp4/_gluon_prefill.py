"""Gluon W4A16 kernel for prefill token counts on Hopper: the weight decoded into shared memory.

``out = x · Wᵀ`` per program: ``BLOCK_M`` tokens × ``BLOCK_N`` weight rows, 64 codes of K per iteration. TMA
brings the activation tile and the packed weight tile (int32 words, the public ``[N, K/2]`` layout) into one of
``STAGES`` stages, two iterations ahead. Each thread takes 16 contiguous bytes of a weight row (32 codes) from
the stage, decodes them with byte tables into 16-bit floats in K order, multiplies by the block scales (exact:
``e2m1 · s`` fits a 16-bit float) and stores them into one of three decoded buffers; wgmma reads both operands
from shared memory, asynchronously, so the tensor cores multiply iteration i while the warps decode i + 1. The
global decode scale and the bias are applied to the float32 result.

Synchronisation: a warpgroup waits for its wgmma i - 1 right after issuing i, and every warp passes the barrier
of iteration i + 1 after that wait. So at the barrier of iteration i all wgmma up to i - 2 have completed: the
stage of iteration i + 2 (last read by wgmma i - 2) is refilled there, and the decoded buffer (i + 1) mod 3
written in the next iteration was last read by wgmma i - 2 as well.

Loads: the packed weight comes by TMA rather than by loads into registers because the proxy fence after the
decoded stores (``fence.proxy.async``, a full memory barrier in SASS) waits for the thread's global loads in
flight: with register prefetches it exposed their latency every iteration (measured: 72.7 → 65.4 µs at
1024 × 4096 × 4096). The scale bytes (2 per thread per iteration) are loaded right after the fence.

Measured on an H200 (``benchmarks/results/2026-11-30-h200-nvfp4-prefill.md``): 0.66-0.79× the speed of bf16
cuBLAS from 1024 to 4096 tokens, 1.2-2.7× that of the tl kernel for fp16. The same pipeline without the decoded
stores matches cuBLAS, and the decode without the wgmma takes as long as the wgmma: they overlap only partly,
most likely limited by shared-memory bandwidth (decoding in warps of their own gained 1-5%).
``benchmarks/NOTES-nvfp4.md`` has the breakdown and what was tried.

Host side and configuration: ``gluon_gemv`` (``PrefillConfig``, ``w4a16_prefill``). Imported only where Gluon
imports and defines it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ._gluon_compat import cta_barrier, tma_load
from ._gluon_kernel import _decoded_codes, _shifted_scales

BLOCK_K = gl.constexpr(64)
"""Codes of K per iteration (128 bytes of 16-bit activations per token: one swizzle row)."""


@gluon.jit
def _decoded(words, DECODE: gl.constexpr, IS_FP16: gl.constexpr):
    """Weight words [R, W] → 16-bit values [R, 8·W] in K order (``DECODE_K_ORDER_ASM``: code c in output c)."""
    R: gl.constexpr = words.shape[0]
    W: gl.constexpr = words.shape[1]
    # Code c0 + 2·c1 + 4·c2 of a word sits at [..., c0, c1, c2]: c2 outermost gives K order.
    codes = gl.permute(_decoded_codes(words, DECODE, IS_FP16), [0, 1, 4, 3, 2])
    return gl.reshape(codes, [R, 8 * W])


@gluon.jit
def _scaled(values, scale_byte, IS_FP16: gl.constexpr):
    """Decoded values [R, K] (``e2m1 · 2^120`` bf16 / ``e2m1 · 2^8`` f16) × block scales [R, K/16] (E4M3 bytes)
    → ``e2m1 · s`` exactly (``_shifted_scales``: ``s · 2^-120`` / ``s · 2^-8``)."""
    R: gl.constexpr = values.shape[0]
    K: gl.constexpr = values.shape[1]
    scale = _shifted_scales(scale_byte, IS_FP16)
    blocks = gl.reshape(values, [R, K // 16, 16])
    scale = gl.convert_layout(scale, gl.SliceLayout(2, blocks.type.layout))
    return gl.reshape(blocks * gl.expand_dims(scale, 2), [R, K])


@gluon.jit
def _prefill_kernel(
    x_desc, w_desc, scales_ptr, decode_scale_ptr, bias_ptr, out_ptr,
    rows, out_features, row_groups, stride_out_row, iterations,
    HAS_BIAS: gl.constexpr, IS_FP16: gl.constexpr, DECODE: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    W_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [num_warps, 1], [1, 0])
    S_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 2], [16, 2], [num_warps, 1], [1, 0])
    W_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    STAGE_BYTES: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes

    m0 = gl.program_id(0) * BLOCK_M
    row0 = gl.program_id(1) * BLOCK_N
    sr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S_LAYOUT))
    sc = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, S_LAYOUT))
    srow = gl.minimum(row0 + sr, out_features - 1)  # rows past N: TMA reads zero codes; any scale will do
    scale_ptrs = scales_ptr + srow[:, None] * row_groups + sc[None, :]

    x_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    p_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], w_desc.layout)
    w_smem = gl.allocate_shared_memory(dtype, [3, BLOCK_N, BLOCK_K], W_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    for s in gl.static_range(2):
        mbarrier.expect(ready.index(s), STAGE_BYTES, pred=s < iterations)
        tma_load(x_desc, [m0, s * BLOCK_K], ready.index(s), x_smem.index(s), pred=s < iterations)
        tma_load(w_desc, [row0, s * (BLOCK_K // 8)], ready.index(s), p_smem.index(s), pred=s < iterations)

    last = iterations - 1
    s_next = gl.load(scale_ptrs)
    s_after = gl.load(scale_ptrs + gl.minimum(1, last) * (BLOCK_K // 16))
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=MMA)
    for it in range(iterations):
        scale_byte = s_next
        s_next = s_after
        stage = it % STAGES
        mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
        words = p_smem.index(stage).load(W_LAYOUT)
        w_buf = w_smem.index(it % 3)
        w_buf.store(_scaled(_decoded(words, DECODE, IS_FP16), scale_byte, IS_FP16))
        fence_async_shared()
        cta_barrier()
        s_after = gl.load(scale_ptrs + gl.minimum(it + 2, last) * (BLOCK_K // 16))
        # Every warpgroup's wgmma it - 2 is done (and every warp has read its packed words): the stage of
        # iteration it + 2 can be refilled.
        refill = it + 2
        r_stage = refill % STAGES
        mbarrier.expect(ready.index(r_stage), STAGE_BYTES, pred=refill < iterations)
        tma_load(x_desc, [m0, refill * BLOCK_K], ready.index(r_stage), x_smem.index(r_stage),
                 pred=refill < iterations)
        tma_load(w_desc, [row0, refill * (BLOCK_K // 8)], ready.index(r_stage), p_smem.index(r_stage),
                 pred=refill < iterations)
        x_buf = x_smem.index(stage)
        acc = warpgroup_mma(x_buf, w_buf.permute((1, 0)), acc, is_async=True)
        acc, x_buf, w_buf = warpgroup_mma_wait(num_outstanding=1, deps=(acc, x_buf, w_buf))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))

    total = acc * gl.load(decode_scale_ptr)
    m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
    n = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    n_mask = n < out_features
    if HAS_BIAS:
        total += gl.load(bias_ptr + n, mask=n_mask, other=0.0).to(gl.float32)[None, :]
    out = out_ptr + m[:, None] * stride_out_row + n[None, :]
    gl.store(out, total.to(out_ptr.dtype.element_ty), mask=(m < rows)[:, None] & n_mask[None, :])
