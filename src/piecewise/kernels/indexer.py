"""The DeepSeek sparse attention indexer's scores over its key cache, in one launch.

``index_scores(q, weights, cache, rows, positions, scale)``: token t of sequence ``rows[t]`` at ``positions[t]``
scores every cached key j of its sequence as ``Σ_h weights[t, h] · relu(q[t, h] · cache[rows[t], j]) · scale``
(DeepSeek-V3.2's lightning indexer, GLM-5's), −inf past its position → [T, max_seq] float32; the caller takes the
top-k. One program per (token, block of keys) reads only keys at or before the token's position, once, for all
heads (one ``tl.dot`` of the key block against the token's heads): the PyTorch formulation gathers each token's
whole cache row range and copies it to float32 first, several times the bytes. No host sync, a grid from shapes
only: capturable. ``index_scores_reference`` is the PyTorch computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - no Triton: the reference only
    triton = None

BLOCK_N = 64
"""Keys per program."""


def index_scores_reference(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                           positions: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D], weights [T, H], cache [sequences, max_seq, D], rows / positions [T] → [T, max_seq] float32."""
    keys = cache[rows].float()  # [T, max_seq, D]
    scores = F.relu(torch.einsum("thd,tjd->thj", q.float(), keys)) * scale
    index = torch.einsum("th,thj->tj", weights.float(), scores)
    key_positions = torch.arange(cache.shape[1], device=q.device)
    return index.masked_fill(key_positions[None, :] > positions[:, None], float("-inf"))


if triton is not None:

    @triton.jit
    def _index_scores_kernel(
        q_ptr, w_ptr, cache_ptr, rows_ptr, positions_ptr, out_ptr, scale, max_seq,
        stride_q_token, stride_q_head, stride_w_token, stride_c_seq, stride_c_pos, stride_out_token,
        HEADS: tl.constexpr, BLOCK_H: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    ):
        token = tl.program_id(0)
        block = tl.program_id(1)
        position = tl.load(positions_ptr + token).to(tl.int64)
        n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        scores = tl.full([BLOCK_N], float("-inf"), tl.float32)
        if block * BLOCK_N <= position:  # a block wholly past the position reads nothing
            row = tl.load(rows_ptr + token).to(tl.int64)
            h = tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_D)
            h_ok = h < HEADS
            d_ok = d < DIM
            n_ok = (n <= position) & (n < max_seq)
            q = tl.load(q_ptr + token * stride_q_token + h[:, None] * stride_q_head + d[None, :],
                        mask=h_ok[:, None] & d_ok[None, :], other=0.0)
            k = tl.load(cache_ptr + row * stride_c_seq + n[:, None] * stride_c_pos + d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(k, tl.trans(q.to(k.dtype)), input_precision=PRECISION)  # [BLOCK_N, BLOCK_H]
            w = tl.load(w_ptr + token * stride_w_token + h, mask=h_ok, other=0.0).to(tl.float32)
            total = tl.sum(tl.maximum(s, 0.0) * w[None, :], 1) * scale
            scores = tl.where(n_ok, total, float("-inf"))
        tl.store(out_ptr + token * stride_out_token + n, scores, mask=n < max_seq)


def index_scores(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                 positions: torch.Tensor, scale: float) -> torch.Tensor:
    """As ``index_scores_reference``, by the Triton kernel (the cache's last dimension contiguous)."""
    if triton is None:
        raise RuntimeError("index_scores needs Triton: use index_scores_reference")
    tokens, heads, dim = q.shape
    max_seq = cache.shape[1]
    if cache.stride(2) != 1:
        raise ValueError("index_scores needs the key dimension contiguous in the cache (make it with torch.zeros)")
    q = q if q.stride(2) == 1 else q.contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    out = torch.empty(tokens, max_seq, device=q.device, dtype=torch.float32)
    if tokens == 0:
        return out
    _index_scores_kernel[(tokens, triton.cdiv(max_seq, BLOCK_N))](
        q, weights, cache, rows, positions, out, scale, max_seq,
        q.stride(0), q.stride(1), weights.stride(0), cache.stride(0), cache.stride(1), out.stride(0),
        HEADS=heads, BLOCK_H=max(16, triton.next_power_of_2(heads)), DIM=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=BLOCK_N,
        PRECISION="ieee" if cache.dtype == torch.float32 else "tf32", num_warps=4,
    )
    return out
