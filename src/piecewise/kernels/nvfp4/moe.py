"""Routed MoE experts with NVFP4 weights in static shapes (no host sync), so they capture in a CUDA graph.

``moe_nvfp4(x, ids, weights, gate_up..., down...)``: x [T, H], expert ids and routing weights [T, k], each
expert a SwiGLU MLP with NVFP4 weights stacked over experts (packed [E, N, K/2], E4M3 scales [E, N, K/16],
decode scales [E]; for gate_up also [E, 2]: one for the gate half of the rows and one for the up half, as
checkpoints that quantize gate and up separately have them). The output is Σ_j weights[t, j] ·
expert_{ids[t, j]}(x[t]).

How (as vLLM's fused MoE does): ``align`` sorts the T·k (token, expert) pairs by expert and pads each expert's
pairs to whole blocks of ``BLOCK_M`` rows, with device-side tensors of a fixed size (the number of blocks is at
most ⌈T·k / BLOCK_M⌉ + E). One launch of the grouped W4A16 kernel then computes every block against its
expert's weight, the decode of ``triton_gemm`` in registers; a second launch does the down projection and
multiplies each pair's row by its routing weight; the k rows of a token are summed last. Empty blocks exit at
once. On CPU the op runs the per-expert reference loop (there is no graph to capture there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...opaque import opaque_op
from ..routing import routed_sum
from .functional import linear

try:
    import triton
    import triton.language as tl

    from .triton_gemm import _scaled_tile
except Exception:  # noqa: BLE001 - no Triton: CPU only
    triton = None

BLOCK_M = 16
"""Pairs per block: tl.dot's minimum (decode has few pairs per expert)."""


def align(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] → (rows [B·block_m]: pair indices grouped by expert, each expert's padded to whole
    blocks, padding = T·k; block_expert [B]: each block's expert, -1 past the last used block), with
    B = ⌈T·k / block_m⌉ + E. Static shapes, device-side only."""
    pairs = ids.numel()
    flat = ids.reshape(-1)
    blocks_max = -(-pairs // block_m) + num_experts
    order = torch.argsort(flat, stable=True)  # pair indices sorted by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # (bincount would sync to size its output)
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    first_pair = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
    sorted_expert = flat[order]
    rank = torch.arange(pairs, device=ids.device) - first_pair[sorted_expert]
    destination = (block_end - blocks)[sorted_expert] * block_m + rank
    rows = torch.full((blocks_max * block_m,), pairs, dtype=torch.int64, device=ids.device)
    rows.scatter_(0, destination, order)
    block_expert = torch.searchsorted(block_end, torch.arange(blocks_max, device=ids.device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return rows, block_expert


if triton is not None:

    @triton.jit
    def _grouped_kernel(
        x_ptr, weight_ptr, scales_ptr, decode_ptr, route_ptr, out_ptr, rows_ptr, block_expert_ptr,
        pairs, out_features, in_features, stride_x_row, stride_out_row, x_row_div,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IS_FP16: tl.constexpr,
        APPLY_ROUTE: tl.constexpr, HALVES: tl.constexpr,
    ):
        """out[p, n] = (x[p // x_row_div] · W_e[n]) · decode_e (· route[p]) for the pairs p of one block; with
        HALVES, decode_e is decode[e, 0] for the first half of the rows and decode[e, 1] for the second."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        p = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        m_mask = p < pairs
        x_rows = p // x_row_div
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_rows = tl.minimum(n, out_features - 1)  # rows past N read row N-1 (never stored)
        bytes_per_row = in_features // 2
        groups = in_features // 16
        weight_base = weight_ptr + expert.to(tl.int64) * out_features * bytes_per_row
        scale_base = scales_ptr + expert.to(tl.int64) * out_features * groups
        byte = tl.arange(0, BLOCK_K // 2)
        group = tl.arange(0, BLOCK_K // 16)
        k_offsets = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            packed = tl.load(weight_base + n_rows[:, None] * bytes_per_row + (k0 // 2 + byte)[None, :])
            scale_byte = tl.load(scale_base + n_rows[:, None] * groups + (k0 // 16 + group)[None, :])
            weight = _scaled_tile(packed, scale_byte, IS_FP16)
            x_t = tl.load(x_ptr + x_rows[None, :] * stride_x_row + (k0 + k_offsets)[:, None],
                          mask=m_mask[None, :], other=0.0)
            acc = tl.dot(weight, x_t, acc)
        if HALVES:
            acc = acc * tl.load(decode_ptr + 2 * expert + (n >= out_features // 2).to(tl.int32))[:, None]
        else:
            acc = acc * tl.load(decode_ptr + expert)
        if APPLY_ROUTE:
            acc = acc * tl.load(route_ptr + p, mask=m_mask, other=0.0)[None, :]
        out = out_ptr + p[None, :] * stride_out_row + n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(n < out_features)[:, None] & m_mask[None, :])


def _block_k(in_features: int) -> int:
    for block_k in (128, 64, 32, 16):
        if in_features % block_k == 0:
            return block_k
    raise ValueError(f"NVFP4 experts need in_features a multiple of 16, got {in_features}")


def grouped_w4a16(x, weight, scales, decode, rows, block_expert, pairs, x_row_div, route=None, out_dtype=None):
    """One grouped launch: [pairs, N] = per-pair ``x[p // x_row_div] @ W_e.T · decode_e`` (· route[p]); ``decode``
    [E], or [E, 2] for a scale per half of the rows."""
    experts, out_features, packed_cols = weight.shape
    in_features = packed_cols * 2
    out = torch.empty((pairs, out_features), dtype=out_dtype or x.dtype, device=x.device)
    block_n = 64
    grid = (triton.cdiv(out_features, block_n), block_expert.numel())
    _grouped_kernel[grid](
        x, weight, scales.view(torch.uint8), decode, route if route is not None else decode, out, rows, block_expert,
        pairs, out_features, in_features, x.stride(0), out.stride(0), x_row_div,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=_block_k(in_features), IS_FP16=x.dtype == torch.float16,
        APPLY_ROUTE=route is not None, HALVES=decode.dim() == 2, num_warps=4, num_stages=3,
    )
    return out


def moe_nvfp4_cuda(x, ids, weights, gate_up, gate_up_scale, gate_up_scale_2, down, down_scale, down_scale_2):
    """The CUDA path of ``moe_nvfp4``: two grouped launches around the SwiGLU, no host sync."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"NVFP4 experts on CUDA take bf16 or fp16 activations (W4A16), got {x.dtype}")
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    rows, block_expert = align(ids, gate_up.shape[0])
    x = x.contiguous()
    hidden = grouped_w4a16(x, gate_up, gate_up_scale, gate_up_scale_2, rows, block_expert, pairs, top_k)
    gate, up = hidden.chunk(2, dim=-1)
    activated = (F.silu(gate.float()) * up.float()).to(x.dtype)
    routed = grouped_w4a16(activated, down, down_scale, down_scale_2, rows, block_expert, pairs, 1,
                           route=weights.reshape(-1).float().contiguous(), out_dtype=torch.float32)
    return routed.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def moe_nvfp4_reference(x, ids, weights, gate_up, gate_up_scale, gate_up_scale_2, down, down_scale, down_scale_2):
    """The same sum by a loop over the experts that got tokens (``functional.linear`` per expert)."""

    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
        if gate_up_scale_2.dim() == 2:  # gate and up halves with decode scales of their own
            half = gate_up.shape[1] // 2
            gate, up = (linear(rows, gate_up[index, part], gate_up_scale[index, part], gate_up_scale_2[index, j])
                        for j, part in enumerate((slice(0, half), slice(half, None))))
        else:
            gate, up = linear(rows, gate_up[index], gate_up_scale[index], gate_up_scale_2[index]).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, down[index], down_scale[index], down_scale_2[index])

    return routed_sum(x, ids, weights, gate_up.shape[0], expert)


def _moe_fake(x, ids, weights, gate_up, gate_up_scale, gate_up_scale_2, down, down_scale, down_scale_2):
    return x.new_empty(x.shape)


@opaque_op("piecewise_nvfp4::moe", fake=_moe_fake)
def moe_op(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
    gate_up_scale_2: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor, down_scale_2: torch.Tensor,
) -> torch.Tensor:
    """Routed SwiGLU experts with NVFP4 weights: static shapes on CUDA, the reference loop on CPU."""
    run = moe_nvfp4_cuda if x.is_cuda else moe_nvfp4_reference
    return run(x, ids, weights, gate_up, gate_up_scale, gate_up_scale_2, down, down_scale, down_scale_2)
