"""Attention of MLA queries over a latent KV cache, dense or over per-token picks (DeepSeek sparse attention).

``latent_attention(q_latent, q_rope, cache, slots, positions, scale, indices)``: MLA with the key and value
projections absorbed into the query and the output (DeepSeek-V2/V3, GLM-5). Each cache row holds one position's
normalised compressed KV (R = kv_lora_rank values) followed by its rotated key part (P = qk_rope_head_dim
values): cache [sequences, max_seq, R + P]. Token t of sequence ``slots[t]`` at ``positions[t]`` (its own row
already written) scores row j as ``(q_latent[t, h] · row[:R] + q_rope[t, h] · row[R:]) · scale`` and returns the
softmax-weighted sum of the rows' latent parts [T, H, R], which the caller projects through W_UV. Keys are
the rows ``indices[t]`` picks (sparse: the indexer's top-k, invalid picks allowed) or every row (dense, indices
None); either way only rows 0 .. positions[t] are visible.

The Triton kernel runs one program per (token, block of heads): the heads of a token read the same rows (MQA with
a 576-wide head), so each gathered row serves the whole block through three ``tl.dot``: latent and rope scores,
then p·V with V the latent part itself. Online softmax in float32. When tokens × head blocks cannot fill the
GPU (one sequence decoding), the picks are split over several programs and a second launch combines their
partial softmaxes (``latent_splits``). No host sync, a grid from shapes only: capturable in a CUDA graph. It
also runs under ``TRITON_INTERPRET=1``. ``latent_attention_reference`` is the same computation in PyTorch;
``attend_latent`` picks between them.

Blocks (``LatentBlocks``), chosen on an H200 at GLM-5 shapes (H=64, R=512, P=64, bf16, 2048 picks; B=32 is the
case tuned: benchmarks/mla_attention.py --sweep, results in benchmarks/results/2026-12-01-h200-mla-attention.md):
all 64 heads of a token in one program (no row gathered twice), 8 warps, 32 rows a step, three row blocks in
flight. The 64 × 512 float32 sum takes 128 registers a thread, so one program runs per multiprocessor; decode
reaches about a quarter of HBM bandwidth, limited by instruction latency with 8 warps a multiprocessor rather
than by memory. A float32 cache takes 16 heads and 16 rows a step (shared memory). FP8 rows (``latent_fp8``: a
uint8 cache) take the same kernel and blocks, with the codes times their tile's scale read in place of the latent
values (the ``FP8`` branches of the kernel).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import latent_fp8
from .attention import _multiprocessors

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - no Triton: the reference only
    triton = None


@dataclass(frozen=True)
class LatentBlocks:
    """Block sizes of one launch of ``_latent_attention_kernel``."""

    heads: int = 64
    """Query heads per program (at least 16: the rows of ``tl.dot``); fewer heads in the call shrink it."""
    rows: int = 32
    """Cache rows gathered per step of the loop over picks."""
    warps: int = 8
    """``num_warps``."""
    stages: int = 5
    """``num_stages`` over picks: Triton's pipeliner spends two of them on loading the picks, the rest hold
    gathered row blocks in flight (5: three blocks)."""
    rows_first: bool = False
    """Scores as [rows, heads] and the sum as [R, heads]: the queries are then the right-hand operand of the score
    ``tl.dot`` (measured no faster at 64 heads)."""
    dense_stages: int = 3
    """``num_stages`` over contiguous rows (no picks to load: as many row blocks in flight as ``stages``)."""


BLOCKS = {torch.bfloat16: LatentBlocks(), torch.float16: LatentBlocks(),
          torch.float32: LatentBlocks(16, 16, 4, 2, dense_stages=2)}
"""Blocks per cache dtype (float32 rows are twice as wide in shared memory)."""


REFERENCE_VALUES = 1 << 26
"""Most gathered cache values per chunk of tokens in ``latent_attention_reference``."""


def latent_attention_reference(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                               positions: torch.Tensor, scale: float, indices: torch.Tensor | None = None,
                               ) -> torch.Tensor:
    """The PyTorch reference → [T, H, R] in q_latent's dtype, computed in float32 (float64 inputs: float64).

    q_latent [T, H, R], q_rope [T, H, P], cache [sequences, max_seq, R + P], slots / positions [T], indices
    [T, K] or None (every row). Row j of token t's sequence is visible when 0 ≤ j ≤ positions[t] and j < max_seq;
    a token with no visible row gets zeros. Tokens go in chunks, so that the gathered rows stay near
    ``REFERENCE_VALUES`` values whatever T and K are."""
    tokens, heads, latent = q_latent.shape
    max_seq = cache.shape[1]
    compute = torch.promote_types(q_latent.dtype, torch.float32)
    out = torch.zeros(tokens, heads, latent, device=q_latent.device, dtype=q_latent.dtype)
    if indices is None:
        indices = torch.arange(max_seq, device=cache.device).expand(tokens, max_seq)
    picks = max(1, indices.shape[1])
    chunk = max(1, REFERENCE_VALUES // (picks * cache.shape[2]))
    for first in range(0, tokens, chunk):
        part = slice(first, first + chunk)
        index = indices[part].long()
        visible = (index >= 0) & (index <= positions[part, None]) & (index < max_seq)  # [t, K]
        rows = cache[slots[part, None], index.clamp(0, max_seq - 1)]  # [t, K, R + P] (FP8: bytes)
        rows = latent_fp8.dequantize_rows(rows, latent, compute) if cache.dtype == torch.uint8 else rows.to(compute)
        scores = (torch.einsum("thr,tkr->thk", q_latent[part].to(compute), rows[..., :latent])
                  + torch.einsum("thp,tkp->thk", q_rope[part].to(compute), rows[..., latent:])) * scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # no visible row: all -inf, zeros instead of NaN
        out[part] = torch.einsum("thk,tkr->thr", weights, rows[..., :latent]).to(out.dtype)
    return out


if triton is not None:

    @triton.jit
    def _rescale(acc, row_sum, row_max, block_max, ROWS_FIRST: tl.constexpr):
        """The running sum and denominator moved to the new maxima (heads without a visible row stay at -inf)."""
        new_max = tl.maximum(row_max, block_max)
        alpha = tl.math.exp2(row_max - tl.where(new_max == float("-inf"), 0.0, new_max))
        if ROWS_FIRST:
            acc = acc * alpha[None, :]
        else:
            acc = acc * alpha[:, None]
        return acc, row_sum * alpha, new_max

    @triton.jit
    def _picked_rows(indices_ptr, token, stride_index_token, stride_index_pick, rows_base, stride_cache_pos, position,
                     max_seq, picks, first, chunk, start, BLOCK_N: tl.constexpr, SPARSE: tl.constexpr):
        """Row pointers [BLOCK_N, 1] of the picks start .. start + BLOCK_N - 1 of the share first .. first + chunk - 1
        (dense: of the rows) and which of them are visible."""
        n = start + tl.arange(0, BLOCK_N)
        n_ok = (n < first + chunk) & (n < picks)
        if SPARSE:
            j = tl.load(indices_ptr + token * stride_index_token + n * stride_index_pick, mask=n_ok,
                        other=-1).to(tl.int64)
        else:
            j = n.to(tl.int64)
        j_ok = n_ok & (j >= 0) & (j <= position) & (j < max_seq)
        return rows_base + j[:, None] * stride_cache_pos, j_ok

    @triton.jit
    def _latent_columns(rows, j_ok, LATENT: tl.constexpr, BLOCK_R: tl.constexpr, FP8: tl.constexpr,
                        TILE: tl.constexpr, dtype):
        """The latent columns of a row block → [BLOCK_N, BLOCK_R] in ``dtype``; FP8 rows (``latent_fp8``, rows point
        at bytes): each float8 code times its tile's float32 scale, the scales loaded one per tile and row (not per
        value: a [rows, columns] float32 gather would take more shared memory in flight than the rows themselves)."""
        c = tl.arange(0, BLOCK_R)
        mask = j_ok[:, None] & (c < LATENT)[None, :]
        if FP8:
            codes = tl.load((rows + c[None, :]).to(tl.pointer_type(tl.float8e4nv)), mask=mask, other=0.0)
            codes = codes.to(tl.float32)
            scale_ptr = (rows + LATENT).to(tl.pointer_type(tl.float32))  # [BLOCK_N, 1]
            if TILE >= LATENT or BLOCK_R <= TILE:  # one tile: one scale a row
                scale = tl.load(scale_ptr, mask=j_ok[:, None], other=0.0)
                values = codes * scale
            else:  # BLOCK_R / TILE whole tiles (both powers of 2)
                tiles = tl.arange(0, BLOCK_R // TILE)
                scale = tl.load(scale_ptr + tiles[None, :], mask=j_ok[:, None] & (tiles < LATENT // TILE)[None, :],
                                other=0.0)  # [BLOCK_N, BLOCK_R // TILE]
                values = tl.reshape(tl.reshape(codes, [codes.shape[0], BLOCK_R // TILE, TILE]) * scale[:, :, None],
                                    [codes.shape[0], BLOCK_R])
            columns = values.to(dtype)
        else:
            columns = tl.load(rows + c[None, :], mask=mask, other=0.0)
        return columns

    @triton.jit
    def _scores(rows, j_ok, q_latent, q_rope, p, p_ok, qk_scale, LATENT: tl.constexpr, BLOCK_R: tl.constexpr,
                ROWS_FIRST: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, TILE: tl.constexpr):
        """Scores (base 2, invisible rows at -inf) of one row block → ([BLOCK_H, BLOCK_N], or [BLOCK_N, BLOCK_H] when
        ROWS_FIRST), and the block's latent columns [BLOCK_N, BLOCK_R], which serve both the scores and p·V."""
        kv = _latent_columns(rows, j_ok, LATENT, BLOCK_R, FP8, TILE, q_rope.dtype)  # [BLOCK_N, BLOCK_R]
        if ROWS_FIRST:
            s = tl.dot(kv, q_latent, input_precision=PRECISION)
        else:
            s = tl.dot(q_latent, tl.trans(kv), input_precision=PRECISION)
        if FP8:  # after the codes and the scales, in bfloat16
            k_rope = tl.load((rows + LATENT + 4 * (LATENT // TILE) + 2 * p[None, :]).to(tl.pointer_type(tl.bfloat16)),
                             mask=j_ok[:, None] & p_ok[None, :], other=0.0).to(q_rope.dtype)
        else:
            k_rope = tl.load(rows + LATENT + p[None, :], mask=j_ok[:, None] & p_ok[None, :], other=0.0)
        if ROWS_FIRST:
            s = tl.dot(k_rope, q_rope, acc=s, input_precision=PRECISION) * qk_scale
            s = tl.where(j_ok[:, None], s, float("-inf"))
        else:
            s = tl.dot(q_rope, tl.trans(k_rope), acc=s, input_precision=PRECISION) * qk_scale
            s = tl.where(j_ok[None, :], s, float("-inf"))
        return s, kv

    @triton.jit
    def _accumulate(acc, row_sum, row_max, s, kv, ROWS_FIRST: tl.constexpr, PRECISION: tl.constexpr):
        """One row block's scores and latent columns added to the online softmax → (acc, row_sum, row_max)."""
        if ROWS_FIRST:
            block_max = tl.max(s, 0)
        else:
            block_max = tl.max(s, 1)
        # Rescale to the new maxima every step (rescaling only past a growth of 2^8, FlashAttention-4's rule,
        # measured slower: the branch costs the pipelining more). A head without a visible row yet keeps -inf.
        acc, row_sum, row_max = _rescale(acc, row_sum, row_max, block_max, ROWS_FIRST)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        if ROWS_FIRST:
            weights = tl.math.exp2(s - shift[None, :])
            row_sum += tl.sum(weights, 0)
            acc = tl.dot(tl.trans(kv), weights.to(kv.dtype), acc=acc, input_precision=PRECISION)
        else:
            weights = tl.math.exp2(s - shift[:, None])
            row_sum += tl.sum(weights, 1)
            acc = tl.dot(weights.to(kv.dtype), kv, acc=acc, input_precision=PRECISION)
        return acc, row_sum, row_max

    @triton.jit
    def _latent_attention_kernel(
        q_latent_ptr, q_rope_ptr, cache_ptr, indices_ptr, slots_ptr, positions_ptr, out_ptr, part_ptr, stats_ptr,
        scale, max_seq, picks, splits, chunk, stride_ql_token, stride_ql_head, stride_qr_token, stride_qr_head,
        stride_cache_slot, stride_cache_pos, stride_index_token, stride_index_pick, stride_out_token, stride_out_head,
        HEADS: tl.constexpr, HEAD_BLOCKS: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, SPARSE: tl.constexpr, ROWS_FIRST: tl.constexpr, PRECISION: tl.constexpr,
        INTERPRETED: tl.constexpr, FP8: tl.constexpr, TILE: tl.constexpr,
    ):
        """One program of the attention: (token, head block, split) from the flat program id. ``FP8``: the cache
        is bytes, ``latent_fp8``'s layout with ``TILE`` latent values a scale (not read otherwise)."""
        # One flat grid, head blocks fastest: the programs that gather the same rows run side by side (L2 hits).
        program = tl.program_id(0)
        head_block = program % HEAD_BLOCKS
        split = (program // HEAD_BLOCKS) % splits
        token = (program // (HEAD_BLOCKS * splits)).to(tl.int64)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        position = tl.load(positions_ptr + token).to(tl.int64)
        first = split * chunk  # this program's share of the picks (dense: of the rows): first .. first + chunk - 1
        h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        p = tl.arange(0, BLOCK_P)
        h_ok = h < HEADS
        p_ok = p < ROPE
        c = tl.arange(0, BLOCK_R)
        q_latent = tl.load(q_latent_ptr + token * stride_ql_token + h[:, None] * stride_ql_head + c[None, :],
                           mask=h_ok[:, None] & (c < LATENT)[None, :], other=0.0)
        if ROWS_FIRST:  # scores [rows, heads] and the sum transposed: the queries stay in shared memory
            q_latent = tl.trans(q_latent)
        q_rope = tl.load(q_rope_ptr + token * stride_qr_token + h[:, None] * stride_qr_head + p[None, :],
                         mask=h_ok[:, None] & p_ok[None, :], other=0.0)
        rows_base = cache_ptr + slot * stride_cache_slot
        qk_scale = scale * 1.4426950408889634  # scores in base 2: exp2 below
        row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_H], tl.float32)
        if ROWS_FIRST:
            acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
            q_rope = tl.trans(q_rope)
        else:
            acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        # Sparse: every pick of the share (any may be visible). Dense: rows first .. position of the share only,
        # except in the interpreter, which cannot bound a loop by a loaded value: there, the whole share, masked.
        if SPARSE or INTERPRETED:
            steps = chunk
        else:
            steps = (tl.minimum(tl.minimum(first + chunk, position + 1), max_seq) - first).to(tl.int32)
        for offset in range(0, steps, BLOCK_N):
            rows, j_ok = _picked_rows(indices_ptr, token, stride_index_token, stride_index_pick, rows_base,
                                      stride_cache_pos, position, max_seq, picks, first, chunk, first + offset,
                                      BLOCK_N, SPARSE)
            s, kv = _scores(rows, j_ok, q_latent, q_rope, p, p_ok, qk_scale, LATENT, BLOCK_R, ROWS_FIRST, PRECISION,
                            FP8, TILE)
            acc, row_sum, row_max = _accumulate(acc, row_sum, row_max, s, kv, ROWS_FIRST, PRECISION)
        if ROWS_FIRST:
            acc = tl.trans(acc)
        ok = h_ok[:, None] & (c < LATENT)[None, :]
        if SPLIT:  # this share's unnormalised sum, its max (base 2) and its softmax denominator, for _combine_kernel
            row = (token * HEADS + h) * splits + split
            tl.store(part_ptr + row[:, None] * LATENT + c[None, :], acc, mask=ok)
            tl.store(stats_ptr + row * 2, row_max, mask=h_ok)
            tl.store(stats_ptr + row * 2 + 1, row_sum, mask=h_ok)
        else:
            out = tl.where(row_sum[:, None] > 0, acc / row_sum[:, None], 0.0)  # no visible row: zeros
            tl.store(out_ptr + token * stride_out_token + h[:, None] * stride_out_head + c[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _combine_kernel(
        part_ptr, stats_ptr, out_ptr, splits, stride_out_token, stride_out_head,
        HEADS: tl.constexpr, LATENT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        split = tl.arange(0, BLOCK_S)
        r = tl.arange(0, BLOCK_R)
        s_ok = split < splits
        row = (token * HEADS + head) * splits + split
        row_max = tl.load(stats_ptr + row * 2, mask=s_ok, other=float("-inf"))
        row_sum = tl.load(stats_ptr + row * 2 + 1, mask=s_ok, other=0.0)
        top = tl.max(row_max, 0)
        weight = tl.where(row_max == float("-inf"), 0.0, tl.math.exp2(row_max - top))
        part = tl.load(part_ptr + row[:, None] * LATENT + r[None, :], mask=s_ok[:, None] & (r < LATENT)[None, :],
                       other=0.0)
        total = tl.sum(row_sum * weight, 0)
        out = tl.sum(part * weight[:, None], 0) / tl.where(total > 0, total, 1.0)  # no visible row anywhere: zeros
        tl.store(out_ptr + token * stride_out_token + head * stride_out_head + r, out.to(out_ptr.dtype.element_ty),
                 mask=r < LATENT)


SPLIT_PICKS = 64
"""Fewest picks (or cache rows) per split of a (token, head block)'s keys."""


def latent_splits(tokens: int, head_blocks: int, picks: int, device: torch.device) -> int:
    """How many programs share one (token, head block)'s picks: as many as fit the multiprocessors in one wave
    when tokens × head blocks are fewer than them (decode of a few sequences), at least ``SPLIT_PICKS`` picks
    each; 1 otherwise. ``head_blocks``: the programs of a token before splitting."""
    programs = tokens * head_blocks
    return max(1, min(_multiprocessors(device) // programs, picks // SPLIT_PICKS))


def _check(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, indices: torch.Tensor | None) -> None:
    tokens, heads, latent = q_latent.shape
    if q_rope.dim() != 3 or q_rope.shape[:2] != (tokens, heads):
        raise ValueError(f"q_rope must be [T, H, P] with q_latent's T, H = {tokens}, {heads}; got {tuple(q_rope.shape)}")
    fp8 = cache.dtype == torch.uint8
    width = latent_fp8.row_bytes(latent, q_rope.shape[2]) if fp8 else latent + q_rope.shape[2]
    if cache.dim() != 3 or cache.shape[2] != width:
        raise ValueError(f"cache must be [sequences, max_seq, R + P] = [.., .., {width}]"
                         f"{' (FP8 rows: bytes)' if fp8 else ''}; got {tuple(cache.shape)}")
    if not q_latent.dtype == q_rope.dtype == (q_latent.dtype if fp8 else cache.dtype):
        raise ValueError(f"q_latent, q_rope and cache must share a dtype; got {q_latent.dtype}, {q_rope.dtype}, "
                         f"{cache.dtype}")
    if slots.shape != (tokens,) or positions.shape != (tokens,):
        raise ValueError(f"slots and positions must be [T] = [{tokens}]; got {tuple(slots.shape)}, "
                         f"{tuple(positions.shape)}")
    if indices is not None and (indices.dim() != 2 or indices.shape[0] != tokens
                                or indices.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"indices must be [T, K] int32 or int64 with T = {tokens}; got {tuple(indices.shape)} "
                         f"{indices.dtype}")


def latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, scale: float, indices: torch.Tensor | None = None,
                     splits: int | None = None, *, blocks: LatentBlocks | None = None) -> torch.Tensor:
    """q_latent [T, H, R], q_rope [T, H, P], cache [sequences, max_seq, R + P] (the call's rows already written;
    or uint8 FP8 rows of ``latent_fp8``, read as float8 code · scale in the queries' dtype),
    slots / positions [T], indices [T, K] (int32 or int64) or None → [T, H, R]. Triton kernel; visibility as in
    ``latent_attention_reference``. ``splits`` (default ``latent_splits``): programs per (token, head block),
    each over a contiguous share of the picks, then one combining launch; 1 is a single launch. ``blocks``
    (default ``BLOCKS`` by dtype): block sizes, for tuning."""
    if triton is None:
        raise RuntimeError("latent_attention needs Triton: use latent_attention_reference")
    _check(q_latent, q_rope, cache, slots, positions, indices)
    tokens, heads, latent = q_latent.shape
    rope = q_rope.shape[2]
    max_seq = cache.shape[1]
    if cache.stride(2) != 1:
        raise ValueError("latent_attention needs the cache's last dimension contiguous (make it with torch.zeros)")
    if q_latent.stride(2) != 1:
        q_latent = q_latent.contiguous()
    if q_rope.stride(2) != 1:
        q_rope = q_rope.contiguous()
    out = torch.empty(tokens, heads, latent, device=q_latent.device, dtype=q_latent.dtype)
    if tokens == 0:
        return out
    fp8 = cache.dtype == torch.uint8
    blocks = blocks or BLOCKS.get(q_latent.dtype if fp8 else cache.dtype, LatentBlocks())
    block_h = min(blocks.heads, max(16, triton.next_power_of_2(heads)))
    head_blocks = -(-heads // block_h)
    picks = max_seq if indices is None else indices.shape[1]
    if splits is None:
        splits = latent_splits(tokens, head_blocks, picks, q_latent.device)
    chunk = max(1, -(-picks // max(1, splits) // blocks.rows)) * blocks.rows  # ⌈picks / splits⌉ in whole steps
    splits = max(1, -(-picks // chunk))  # no split without picks
    if splits > 1:
        part = torch.empty(tokens, heads, splits, latent, device=q_latent.device, dtype=torch.float32)
        stats = torch.empty(tokens, heads, splits, 2, device=q_latent.device, dtype=torch.float32)
    else:
        part = stats = out  # not written
    index = indices if indices is not None else slots  # not read when dense
    _latent_attention_kernel[(tokens * splits * head_blocks,)](
        q_latent, q_rope, cache, index, slots, positions, out, part, stats, scale, max_seq, picks, splits, chunk,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0), cache.stride(1),
        index.stride(0), index.stride(1) if indices is not None else 1, out.stride(0), out.stride(1),
        HEADS=heads, HEAD_BLOCKS=head_blocks, LATENT=latent, ROPE=rope, BLOCK_R=max(16, triton.next_power_of_2(latent)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)), BLOCK_H=block_h, BLOCK_N=blocks.rows, SPLIT=splits > 1,
        SPARSE=indices is not None, ROWS_FIRST=blocks.rows_first,
        PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", FP8=fp8, TILE=latent_fp8.tile(latent),
        num_warps=blocks.warps, num_stages=blocks.stages if indices is not None else blocks.dense_stages,
    )
    if splits > 1:
        _combine_kernel[(tokens, heads)](
            part, stats, out, splits, out.stride(0), out.stride(1), HEADS=heads, LATENT=latent,
            BLOCK_R=triton.next_power_of_2(latent), BLOCK_S=max(2, triton.next_power_of_2(splits)),
        )
    return out


def attend_latent(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                  positions: torch.Tensor, scale: float, indices: torch.Tensor | None = None) -> torch.Tensor:
    """MLA attention of the call's tokens over a latent cache that already holds their rows → [T, H, R]: the
    Triton kernel on CUDA when Triton imports, else ``latent_attention_reference``."""
    if q_latent.is_cuda and triton is not None:
        return latent_attention(q_latent, q_rope, cache, slots, positions, scale, indices)
    return latent_attention_reference(q_latent, q_rope, cache, slots, positions, scale, indices)
