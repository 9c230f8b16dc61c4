"""Attention of tokens from many sequences over a multi-sequence KV cache, in one launch.

``slot_attention(q, cache_k, cache_v, slots, positions, scale)``: token t (q [T, Hq, D]) belongs to sequence
``slots[t]`` and sits at ``positions[t]``; it attends causally over ``cache_k[slots[t], :positions[t] + 1]``
(cache [sequences, max_seq, Hkv, D]). One program per (token, KV head) reads only that prefix of its
sequence's cache, with the query heads that share the KV head stacked as the rows of ``tl.dot``, and an
online softmax in float32. No host sync and no copy of the cache: a decode step of B sequences is one launch
per layer whatever the slots are. When few tokens meet a long cache (one sequence decoding over a long
context) the keys are split over several programs per (token, KV head), as flash decoding does, and a second
launch combines their partial softmaxes (``key_splits``). Sliding windows and logit softcapping are options.
It also runs under ``TRITON_INTERPRET=1``. ``slot_attention_reference`` is the same computation in PyTorch,
one sequence at a time; ``attend`` picks between them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - no Triton: the reference only
    triton = None

BLOCK_N = 64
"""Keys per step of the loop over a sequence's cache."""


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with cuDNN's backend left out on CUDA (FlashAttention, then
    memory-efficient attention, then math, as torch orders them otherwise). torch picks cuDNN first on Hopper, and
    cuDNN builds an execution plan for every new shape: 57-90 ms each on an H200 with torch 2.11 (110-434 ms for a
    prefill), against 0.7-1.9 ms for the others' first call (benchmarks/RESULTS.md, "cuDNN's attention plans"). A
    capture over 51 batch sizes paid it 51 times, and a prefill pays it at every new prompt length.

    Eagerly, torch's own process-wide flag is turned off for this call only (1 µs on a 2-core CPU; the context
    manager costs 33), so another thread's SDPA during the call runs without cuDNN too. Under Dynamo, which cannot
    trace the flag, it is ``sdpa_kernel`` (traced as such). Where the caller left neither FlashAttention nor
    memory-efficient attention enabled (``sdpa_kernel([CUDNN_ATTENTION])``), the call is SDPA's own."""
    if not query.is_cuda:
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
    if torch.compiler.is_compiling():
        with sdpa_kernel(_NOT_CUDNN):
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
    backends = torch.backends.cuda
    if not backends.cudnn_sdp_enabled() or not (backends.flash_sdp_enabled() or backends.mem_efficient_sdp_enabled()):
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
    backends.enable_cudnn_sdp(False)
    try:
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
    finally:
        backends.enable_cudnn_sdp(True)


_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend_over_cache(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
                      scale: float | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [T, Hq, D] of one sequence at ``positions`` attends causally over its cache [S, Hkv, D] → [T, Hq·D].

    ``window`` > 0: only the last ``window`` positions up to the token's own (transformers' sliding window,
    key visible when ``position - window < key ≤ position``). ``softcap`` > 0: scores become
    ``softcap · tanh(score / softcap)`` before the softmax (Gemma 2)."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = cache_k.shape[1]
    keys = cache_k.transpose(0, 1)  # [Hkv, S, D]
    values = cache_v.transpose(0, 1)
    group = q_heads // kv_heads
    # [Hkv, group·T, D]: the query heads of one KV head attend to it together (no K/V expansion).
    query = q.view(tokens, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, group * tokens, head_dim)
    key_positions = torch.arange(cache_k.shape[0], device=q.device)
    visible = key_positions[None, :] <= positions[:, None]  # [T, S] causal over the cache
    if window > 0:
        visible &= key_positions[None, :] > positions[:, None] - window
    mask = visible.repeat(group, 1)
    if softcap > 0:  # SDPA has no softcap: the scores written out, softmax in float32
        scale = scale if scale is not None else head_dim**-0.5
        scores = (query.float() @ keys.float().transpose(1, 2)) * scale
        scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask, float("-inf"))
        out = (torch.softmax(scores, dim=-1) @ values.float()).to(q.dtype)
    else:
        out = sdpa(query, keys, values, attn_mask=mask, scale=scale)
    return out.view(kv_heads, group, tokens, head_dim).permute(2, 0, 1, 3).reshape(tokens, q_heads * head_dim)


def slot_attention_reference(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                             positions: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The PyTorch reference: ``attend_over_cache`` once per sequence in the call → [T, Hq, D], contiguous."""
    out = q.new_empty(q.shape)
    for slot in torch.unique(slots).tolist():
        index = (slots == slot).nonzero().squeeze(1)
        out[index] = attend_over_cache(q[index], cache_k[slot], cache_v[slot], positions[index], scale, window,
                                       softcap).view(index.numel(), *q.shape[1:])
    return out


_CALL_LAYOUTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("piecewise_call_layouts", default=None)


@contextlib.contextmanager
def one_layout_per_call() -> Iterator[None]:
    """Within it, ``slot_attention_batched`` reads the layout of a call's ``slots`` and ``positions`` (which
    sequences, how long, from where) from the device once and reuses it for every layer given the same two
    tensors: one host sync per call instead of one per layer. ``TokenModel`` enters it for each call."""
    token = _CALL_LAYOUTS.set({})
    try:
        yield
    finally:
        _CALL_LAYOUTS.reset(token)


def _layout(slots: torch.Tensor, positions: torch.Tensor) -> dict:
    """The call's sequences as rows of a padded batch: ``ids`` (their slots), ``inverse`` / ``rank`` (each
    token's row and place in it), ``longest``, ``keys_len`` (keys up to the highest position), ``fresh`` (each
    sequence starts at position 0 here) and ``packed`` (the tokens already sequence after sequence, each as
    long as the longest: the batch is a view of the call's rows)."""
    memo = _CALL_LAYOUTS.get()
    key = (id(slots), id(positions))
    if memo is not None and key in memo:
        return memo[key][0]
    tokens = slots.shape[0]
    ids, inverse, counts = torch.unique(slots, return_inverse=True, return_counts=True)
    order = torch.argsort(inverse, stable=True)  # tokens grouped by sequence, in call order within each
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(tokens, device=slots.device) - starts[inverse[order]]  # each token's row in its sequence
    fresh = (positions == rank).all()
    packed = (order == torch.arange(tokens, device=slots.device)).all() & (counts == counts[0]).all()
    longest, highest, fresh, packed = torch.stack([counts.max(), positions.max(), fresh.long(),
                                                   packed.long()]).tolist()
    layout = {"ids": ids, "inverse": inverse, "rank": rank, "longest": longest, "keys_len": highest + 1,
              "fresh": bool(fresh), "packed": bool(packed), "masks": {}}
    if memo is not None:  # the tensors kept with it: their ids stay theirs while the memo lives
        memo[key] = (layout, slots, positions)
    return layout


def slot_attention_batched(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                           positions: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """``slot_attention_reference`` as one SDPA over every sequence of the call (long prefills of many prompts):
    each sequence's queries padded to the longest, its keys the cache's rows up to the call's highest position;
    one host read of the call's layout (per call within ``one_layout_per_call``), where the reference reads it
    once per sequence → [T, Hq, D]."""
    tokens, q_heads, head_dim = q.shape
    layout = _layout(slots, positions)
    ids, inverse, rank, longest = layout["ids"], layout["inverse"], layout["rank"], layout["longest"]
    batch = ids.numel()
    if batch * longest > 2 * tokens + 64:  # lengths far apart: padding to the longest would cost more than it saves
        return slot_attention_reference(q, cache_k, cache_v, slots, positions, scale, window)
    if layout["packed"]:
        query = q.view(batch, longest, q_heads, head_dim)
    else:
        query = q.new_zeros(batch, longest, q_heads, head_dim)
        query[inverse, rank] = q

    def unbatch(out: torch.Tensor) -> torch.Tensor:  # [B, Hq, L, D] → the call's rows [T, Hq, D], contiguous as the
        # op's fake says (SDPA's output may follow the query's strides)
        out = out.transpose(1, 2)
        return out.reshape(tokens, q_heads, head_dim).contiguous() if layout["packed"] else out[inverse, rank]

    gqa = cache_k.shape[-2] != q_heads
    if layout["fresh"] and window == 0:  # row i of a sequence sees its keys 0..i: causal, no mask (the fused kernels)
        keys = cache_k[ids, :longest].transpose(1, 2)
        values = cache_v[ids, :longest].transpose(1, 2)
        return unbatch(sdpa(query.transpose(1, 2), keys, values, is_causal=True, scale=scale, enable_gqa=gqa))
    keys_len = layout["keys_len"]
    visible = layout["masks"].get(window)
    if visible is None:
        query_positions = positions.new_full((batch, longest), -1)
        query_positions[inverse, rank] = positions
        key_positions = torch.arange(keys_len, device=q.device)
        visible = key_positions[None, None, :] <= query_positions[:, :, None]  # [B, L, K]
        if window > 0:
            visible &= key_positions[None, None, :] > query_positions[:, :, None] - window
        visible |= (query_positions < 0)[:, :, None] & (key_positions == 0)  # padding rows see one key: no NaN
        visible = layout["masks"][window] = visible[:, None]
    keys = cache_k[ids, :keys_len].transpose(1, 2)  # [B, Hkv, K, D]
    values = cache_v[ids, :keys_len].transpose(1, 2)
    return unbatch(sdpa(query.transpose(1, 2), keys, values, attn_mask=visible, scale=scale, enable_gqa=gqa))


if triton is not None:

    @triton.jit
    def _slot_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, stats_ptr, slots_ptr, positions_ptr, scale, window, softcap,
        stride_q_token, stride_q_head, stride_k_slot, stride_k_pos, stride_k_head,
        stride_v_slot, stride_v_pos, stride_v_head, stride_out_token, stride_out_head,
        Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
        PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        token = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        position = tl.load(positions_ptr + token).to(tl.int32)
        first = split * CHUNK  # this program's share of the cache: first .. first + CHUNK - 1
        lowest = tl.maximum(position - window + 1, 0) if WINDOW else 0  # the sliding window's first key
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + token * stride_q_token + heads[:, None] * stride_q_head + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        k_base = k_ptr + slot * stride_k_slot + kv_head * stride_k_head
        v_base = v_ptr + slot * stride_v_slot + kv_head * stride_v_head
        row_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        # Keys lowest .. position within this share. The interpreter cannot bound a loop by a loaded value: there,
        # the whole share, masked.
        base = first if INTERPRETED else tl.maximum(first, lowest)
        for offset in range(0, CHUNK if INTERPRETED else tl.minimum(first + CHUNK, position + 1) - base, BLOCK_N):
            n = base + offset + tl.arange(0, BLOCK_N)
            n_ok = (n >= lowest) & (n <= position) & (n < first + CHUNK)
            k = tl.load(k_base + n[:, None] * stride_k_pos + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if SOFTCAP:
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # softcap · tanh(s / softcap)
            s = tl.where(n_ok[None, :], s, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(s, 1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key yet: exp(-inf) = 0, not NaN
            p = tl.exp(s - shift[:, None])
            alpha = tl.exp(row_max - shift)
            row_sum = row_sum * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * stride_v_pos + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            row_max = new_max
        ok = g_ok[:, None] & d_ok[None, :]
        if SPLITS == 1:
            out = acc / row_sum[:, None]
            tl.store(out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=ok)
        else:  # this split's unnormalised sum, its max and its softmax denominator, for _combine_kernel
            row = (token * Q_HEADS + heads) * SPLITS + split
            tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=ok)
            tl.store(stats_ptr + row * 2, row_max, mask=g_ok)
            tl.store(stats_ptr + row * 2 + 1, row_sum, mask=g_ok)

    @triton.jit
    def _combine_kernel(
        part_ptr, stats_ptr, out_ptr, stride_out_token, stride_out_head,
        Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        token = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_ok = split < SPLITS
        row = (token * Q_HEADS + head) * SPLITS + split
        row_max = tl.load(stats_ptr + row * 2, mask=s_ok, other=float("-inf"))
        row_sum = tl.load(stats_ptr + row * 2 + 1, mask=s_ok, other=0.0)
        top = tl.max(row_max, 0)  # finite: some split holds the token's own position
        weight = tl.where(row_max == float("-inf"), 0.0, tl.exp(row_max - top))
        part = tl.load(part_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & (d < HEAD_DIM)[None, :],
                       other=0.0)
        out = tl.sum(part * weight[:, None], 0) / tl.sum(row_sum * weight, 0)
        tl.store(out_ptr + token * stride_out_token + head * stride_out_head + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)


SPLIT_KEYS = 1024
"""Fewest cache positions per split of the keys; caches shorter than two of them are never split."""


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def key_splits(tokens: int, kv_heads: int, max_seq: int, device: torch.device) -> int:
    """How many programs share one (token, KV head)'s keys: enough for two per multiprocessor when there are
    few tokens and a long cache (a single sequence decoding over a long context), at least ``SPLIT_KEYS``
    cache positions each; 1 otherwise."""
    programs = tokens * kv_heads
    multiprocessors = _multiprocessors(device)
    if max_seq < 2 * SPLIT_KEYS or programs >= multiprocessors:
        return 1
    return max(1, min(-(-2 * multiprocessors // programs), max_seq // SPLIT_KEYS))


def slot_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                   splits: int | None = None) -> torch.Tensor:
    """q [T, Hq, D], cache_k / cache_v [sequences, max_seq, Hkv, D] (the call's keys already written),
    slots / positions [T] → [T, Hq, D]. Triton kernel; positions past ``max_seq`` are the caller's to refuse.
    ``splits`` (default ``key_splits``): programs per (token, KV head), each over a contiguous share of the
    cache, then one combining launch; 1 is a single launch. ``window`` and ``softcap`` as in
    ``attend_over_cache``."""
    if triton is None:
        raise RuntimeError("slot_attention needs Triton: use slot_attention_reference")
    tokens, q_heads, head_dim = q.shape
    max_seq, kv_heads = cache_k.shape[1], cache_k.shape[2]
    group = q_heads // kv_heads
    if cache_k.stride(3) != 1 or cache_v.stride(3) != 1:
        raise ValueError("slot_attention needs the head dimension contiguous in the cache (make it with torch.zeros)")
    if q.stride(2) != 1:
        q = q.contiguous()
    out = q.new_empty(q.shape)  # contiguous as the ops' fakes, whatever q's layout (the kernel takes its strides)
    if tokens == 0:
        return out
    if splits is None:
        splits = key_splits(tokens, kv_heads, max_seq, q.device)
    chunk = -(-max_seq // max(1, splits) // BLOCK_N) * BLOCK_N  # ⌈max_seq / splits⌉ in whole key blocks
    splits = -(-max_seq // chunk)  # no split without cache positions
    if splits > 1:
        part = torch.empty(tokens, q_heads, splits, head_dim, device=q.device, dtype=torch.float32)
        stats = torch.empty(tokens, q_heads, splits, 2, device=q.device, dtype=torch.float32)
    else:
        part = stats = out  # not written
    _slot_attention_kernel[(tokens, kv_heads, splits)](
        q, cache_k, cache_v, out, part, stats, slots, positions, scale, window, float(softcap),
        q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        cache_v.stride(0), cache_v.stride(1), cache_v.stride(2), out.stride(0), out.stride(1),
        Q_HEADS=q_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=BLOCK_N, SPLITS=splits, CHUNK=chunk,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", WINDOW=window > 0, SOFTCAP=softcap > 0, num_warps=4,
    )
    if splits > 1:
        _combine_kernel[(tokens, q_heads)](
            part, stats, out, out.stride(0), out.stride(1), Q_HEADS=q_heads, HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)),
        )
    return out


KERNEL_TOKENS = 512
"""Most tokens per call for the Triton kernel; past it (prefill) SDPA over the call's sequences is cheaper
(``slot_attention_batched``)."""


def attend(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
           scale: float | None = None, slots: torch.Tensor | None = None, window: int = 0,
           softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of the call's tokens over a KV cache that already holds their keys → [T, Hq, D].

    ``slots`` None: one sequence, cache [max_seq, Hkv, D]; else token t is in sequence ``slots[t]`` of a cache
    [sequences, max_seq, Hkv, D]. On CUDA, up to ``KERNEL_TOKENS`` tokens run the Triton kernel; otherwise the
    PyTorch reference runs. ``window`` / ``softcap``: see ``attend_over_cache``."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if q.is_cuda and triton is not None and q.shape[0] <= KERNEL_TOKENS:
        if slots is None:
            cache_k, cache_v, slots = cache_k.unsqueeze(0), cache_v.unsqueeze(0), torch.zeros_like(positions)
        return slot_attention(q, cache_k, cache_v, slots, positions, scale, window, softcap)
    if slots is None:
        return attend_over_cache(q, cache_k, cache_v, positions, scale, window, softcap).view(q.shape)
    if q.is_cuda and softcap == 0:  # a long prefill of several prompts: one SDPA, not one per sequence
        return slot_attention_batched(q, cache_k, cache_v, slots, positions, scale, window)
    return slot_attention_reference(q, cache_k, cache_v, slots, positions, scale, window, softcap)
