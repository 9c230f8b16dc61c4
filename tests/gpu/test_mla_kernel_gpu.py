"""MLA attention over a latent KV cache (``kernels.mla``) on CUDA at GLM-5 shapes (64 heads, R=512, P=64, 2048
picks) against its PyTorch reference in float32, and replayed from a CUDA graph."""

import pytest
import torch

from piecewise.kernels.mla import LatentBlocks, attend_latent, latent_attention, latent_attention_reference

pytestmark = pytest.mark.gpu

HEADS, LATENT, ROPE, PICKS = 64, 512, 64, 2048
SCALE = (192 + ROPE) ** -0.5  # GLM-5: qk_nope_head_dim 192 + qk_rope_head_dim 64
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
"""Elementwise against the float32 reference: ieee float32 dots; bf16 inputs with the softmax weights rounded to
bf16 before p·V (outputs are O(0.1), so 2e-2 is a few bf16 steps)."""


def decode(batch, max_seq, dtype, generator, sequences=None):
    """``batch`` tokens of distinct sequences at random positions (the first at the cache's end); picks: distinct
    rows up to the position (all of them when fewer than PICKS), the rest -1, and a few past the position."""
    sequences = sequences or batch
    cache = torch.randn(sequences, max_seq, LATENT + ROPE, device="cuda", generator=generator).to(dtype)
    slots = torch.randperm(sequences, device="cuda", generator=generator)[:batch]
    positions = torch.randint(0, max_seq, (batch,), device="cuda", generator=generator)
    positions[0] = max_seq - 1
    indices = picks_for(positions, max_seq, generator)
    q_latent = torch.randn(batch, HEADS, LATENT, device="cuda", generator=generator).to(dtype)
    q_rope = torch.randn(batch, HEADS, ROPE, device="cuda", generator=generator).to(dtype)
    return q_latent, q_rope, cache, slots, positions, indices


def picks_for(positions, max_seq, generator):
    rows = []
    for position in positions.tolist():
        visible = torch.randperm(position + 1, device="cuda", generator=generator)[:PICKS]
        future = torch.arange(position + 1, min(position + 9, max_seq + 8), device="cuda")
        padding = torch.full((PICKS,), -1, device="cuda")
        row = torch.cat([visible, future, padding])[:PICKS]
        rows.append(row[torch.randperm(PICKS, device="cuda", generator=generator)])
    return torch.stack(rows)


def check(out, q_latent, q_rope, cache, slots, positions, indices, spread=1.0):
    """``spread``: the factor the queries were scaled by (the scores' rounding grows with it)."""
    expected = latent_attention_reference(q_latent.float(), q_rope.float(), cache.float(), slots, positions, SCALE,
                                          indices)
    assert out.dtype == q_latent.dtype and not out.isnan().any()
    tolerance = TOLERANCE[q_latent.dtype] * spread
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    assert (out.float() - expected).norm() / expected.norm() < (1e-5 if q_latent.dtype == torch.float32 else 1e-2) * spread


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_seq", [2048, 8192])
@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_kernel_matches_the_reference(dtype, max_seq, batch, sparse, splits):
    generator = torch.Generator(device="cuda").manual_seed(batch * 10 + max_seq)
    q_latent, q_rope, cache, slots, positions, indices = decode(batch, max_seq, dtype, generator)
    indices = indices if sparse else None
    out = latent_attention(q_latent, q_rope, cache, slots, positions, SCALE, indices, splits)
    check(out, q_latent, q_rope, cache, slots, positions, indices)


def test_int32_picks_and_a_token_without_visible_rows():
    generator = torch.Generator(device="cuda").manual_seed(3)
    q_latent, q_rope, cache, slots, positions, indices = decode(4, 2048, torch.bfloat16, generator)
    indices[1] = torch.where(indices[1] > positions[1], indices[1], -1)  # token 1 sees nothing
    for splits in (1, 4):
        out = latent_attention(q_latent, q_rope, cache, slots, positions, SCALE, indices.int(), splits)
        check(out, q_latent, q_rope, cache, slots, positions, indices)
        assert not out[1].any()


def test_prefill_of_8192_tokens_over_2048_picks_each():
    generator = torch.Generator(device="cuda").manual_seed(4)
    tokens = 8192
    cache = torch.randn(1, tokens, LATENT + ROPE, device="cuda", generator=generator).to(torch.bfloat16)
    positions = torch.arange(tokens, device="cuda")
    slots = torch.zeros_like(positions)
    # the indexer's top-k of a causal prefill: up to 2048 rows ≤ position, then -1
    scores = torch.rand(tokens, tokens, device="cuda", generator=generator).masked_fill(
        positions[None, :] > positions[:, None], -1.0)
    top = scores.topk(PICKS, dim=1)
    indices = torch.where(top.values >= 0, top.indices, -1)
    del scores, top
    q_latent = torch.randn(tokens, HEADS, LATENT, device="cuda", generator=generator).to(torch.bfloat16)
    q_rope = torch.randn(tokens, HEADS, ROPE, device="cuda", generator=generator).to(torch.bfloat16)
    out = attend_latent(q_latent, q_rope, cache, slots, positions, SCALE, indices)
    check(out, q_latent, q_rope, cache, slots, positions, indices)


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("splits", [None, 1])
def test_kernel_replays_in_a_cuda_graph_after_its_inputs_change_in_place(sparse, splits):
    generator = torch.Generator(device="cuda").manual_seed(5)
    q_latent, q_rope, cache, slots, positions, indices = decode(8, 2048, torch.bfloat16, generator, sequences=16)
    indices = indices if sparse else None
    latent_attention(q_latent, q_rope, cache, slots, positions, SCALE, indices, splits)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = latent_attention(q_latent, q_rope, cache, slots, positions, SCALE, indices, splits)
    new = decode(8, 2048, torch.bfloat16, generator, sequences=16)
    for buffer, value in zip((q_latent, q_rope, cache, slots, positions), new):
        buffer.copy_(value)
    if sparse:
        indices.copy_(new[-1])
    graph.replay()
    check(out, q_latent, q_rope, cache, slots, positions, indices)


@pytest.mark.parametrize("blocks", [LatentBlocks(), LatentBlocks(32, 32, 8, 5), LatentBlocks(32, 64, 4, 4),
                                    LatentBlocks(16, 32, 4, 5), LatentBlocks(32, 32, 4, 5, rows_first=True)])
@pytest.mark.parametrize("spread", [1.0, 4.0])
def test_block_sizes_match_the_reference(blocks, spread):
    """Block sizes besides the default (fewer heads, more rows, rows first), with queries scaled so that the running
    maxima grow by far from block to block."""
    generator = torch.Generator(device="cuda").manual_seed(6)
    q_latent, q_rope, cache, slots, positions, indices = decode(32, 2048, torch.bfloat16, generator)
    q_latent, q_rope = q_latent * spread, q_rope * spread
    for picks in (indices, None):
        for splits in (None, 1, 8):
            out = latent_attention(q_latent, q_rope, cache, slots, positions, SCALE, picks, splits, blocks=blocks)
            check(out, q_latent, q_rope, cache, slots, positions, picks, spread)


@pytest.mark.parametrize("batch", [1, 32])
def test_fp8_rows_match_the_reference_over_the_rows_read_back(batch):
    """FP8 rows (``kernels.latent_fp8``: 656 bytes a row at GLM-5's shapes) with bf16 queries: the kernel reads each
    code times its tile's scale and the bf16 rotated key, as the reference over the rows read back does, sparse and
    dense, one split and several, also replayed from a CUDA graph."""
    from piecewise.kernels import latent_fp8

    generator = torch.Generator(device="cuda").manual_seed(9)
    q_latent, q_rope, cache, slots, positions, indices = decode(batch, 2048, torch.bfloat16, generator)
    rows = latent_fp8.quantize_rows(cache[..., :LATENT], cache[..., LATENT:])
    assert rows.shape[-1] == 656
    wide = latent_fp8.dequantize_rows(rows, LATENT, torch.bfloat16)
    for picks in (indices, None):
        for splits in (None, 1, 8):
            out = latent_attention(q_latent, q_rope, rows, slots, positions, SCALE, picks, splits)
            check(out, q_latent, q_rope, wide, slots, positions, picks)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_latent(q_latent, q_rope, rows, slots, positions, SCALE, indices)
    graph.replay()
    check(out, q_latent, q_rope, wide, slots, positions, indices)
