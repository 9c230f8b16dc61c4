"""MLA attention over a latent KV cache (``kernels.mla``) on CPU: its reference against attention written out per
token and head in float64, dense and over picks; the Triton kernel under the interpreter against the reference;
its sm_90 build."""

import textwrap
import pytest
import torch
from test_attention_kernel import run_interpreted

from piecewise.kernels.mla import attend_latent, latent_attention_reference

def per_token(q_latent, q_rope, cache, slots, positions, scale, indices=None):
    """Each head of each token over its visible rows (picked, 0 ≤ j ≤ position, j < max_seq), in float64, with an
    explicit softmax; no visible row gives zeros."""
    tokens, heads, latent = q_latent.shape
    max_seq = cache.shape[1]
    out = torch.zeros(tokens, heads, latent, dtype=torch.float64)
    for t in range(tokens):
        picks = range(max_seq) if indices is None else indices[t].tolist()
        rows = [j for j in picks if 0 <= j <= int(positions[t]) and j < max_seq]
        if not rows:
            continue
        keys = cache[int(slots[t]), rows].double()
        for h in range(heads):
            scores = (keys[:, :latent] @ q_latent[t, h].double() + keys[:, latent:] @ q_rope[t, h].double()) * scale
            out[t, h] = torch.softmax(scores, dim=0) @ keys[:, :latent]
    return out


def case(seed, sequences=3, max_seq=70, heads=4, latent=32, rope=16, picks=24, dtype=torch.float32):
    """Decode tokens of two sequences and prefill tokens of a third at block edges (0, 15, 16, 31, 32, 63, 64,
    max_seq - 1); each token picks ``picks`` distinct rows of -3 .. max_seq + 4 (so some are negative, past its
    position or past the cache), its own position among them, except the last token, which sees no row at all."""
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(sequences, max_seq, latent + rope, generator=generator).to(dtype)
    edges = [p for p in (0, 15, 16, 31, 32, 63, 64) if p < max_seq]
    slots = torch.tensor([0, 1] + [2] * len(edges) + [1])
    positions = torch.tensor([max_seq - 1, 5] + edges + [3])
    q_latent = torch.randn(len(slots), heads, latent, generator=generator).to(dtype)
    q_rope = torch.randn(len(slots), heads, rope, generator=generator).to(dtype)
    rows = []
    for t, position in enumerate(positions.tolist()):
        choices = torch.randperm(max_seq + 8, generator=generator)[:picks] - 3
        if t < len(slots) - 1 and position not in choices:
            choices[0] = position
        rows.append(choices if t < len(slots) - 1 else torch.arange(picks) + position + 1)  # the last: all future
    return q_latent, q_rope, cache, slots, positions, (latent + rope) ** -0.5, torch.stack(rows)


SHAPES = [dict(), dict(heads=1, latent=48, rope=8, picks=70), dict(heads=7, latent=16, rope=32, picks=5, max_seq=40),
          dict(sequences=5, max_seq=130, heads=2, picks=100)]


@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("sparse", [True, False])
def test_reference_is_attention_of_each_token_and_head_over_its_visible_rows(shape, sparse):
    q_latent, q_rope, cache, slots, positions, scale, indices = case(shape, **SHAPES[shape])
    indices = indices if sparse else None
    expected = per_token(q_latent, q_rope, cache, slots, positions, scale, indices)
    out = latent_attention_reference(q_latent, q_rope, cache, slots, positions, scale, indices)
    assert out.dtype == q_latent.dtype
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    if sparse:  # int32 picks, float64 inputs (computed in float64)
        out = latent_attention_reference(q_latent.double(), q_rope.double(), cache.double(), slots, positions, scale,
                                         indices.int())
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert not out[-1].any() or not sparse  # the token without a visible pick: zeros


def test_reference_reads_only_picked_rows_up_to_each_position_of_its_own_sequence():
    q_latent, q_rope, cache, slots, positions, scale, indices = case(1)
    expected = latent_attention_reference(q_latent, q_rope, cache, slots, positions, scale, indices)
    noisy = torch.full_like(cache, 1e4)
    for t in range(len(slots)):
        for j in indices[t].tolist():
            if 0 <= j <= int(positions[t]):
                noisy[slots[t], j] = cache[slots[t], j]
    torch.testing.assert_close(latent_attention_reference(q_latent, q_rope, noisy, slots, positions, scale, indices),
                               expected)


def test_reference_in_chunks_of_tokens_is_the_same(monkeypatch):
    from piecewise.kernels import mla

    q_latent, q_rope, cache, slots, positions, scale, indices = case(2)
    whole = latent_attention_reference(q_latent, q_rope, cache, slots, positions, scale, indices)
    monkeypatch.setattr(mla, "REFERENCE_VALUES", 3 * indices.shape[1] * cache.shape[2])  # three tokens a chunk
    torch.testing.assert_close(latent_attention_reference(q_latent, q_rope, cache, slots, positions, scale, indices),
                               whole)


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from piecewise.kernels.mla import LatentBlocks, latent_attention, latent_attention_reference
    from test_mla_kernel import case
    rows_first = LatentBlocks(heads=16, rows=16, warps=4, stages=1, rows_first=True)
    heads_first = LatentBlocks(heads=16, rows=16, warps=4, stages=1, rows_first=False)
    # shape, splits (None: latent_splits, 1 on CPU), blocks, picks as int32
    checks = [(dict(), 1, heads_first, False), (dict(), 3, heads_first, True), (dict(), None, rows_first, False),
              (dict(), 2, rows_first, False),
              (dict(heads=20, latent=40, rope=8, picks=33), 1, rows_first, True),  # masked heads, R and P
              (dict(heads=20, latent=40, rope=8, picks=33), 4, heads_first, False),
              (dict(dtype=torch.float16, picks=40), 3, rows_first, False),
              (dict(dtype=torch.float16), 1, heads_first, False),
              (dict(picks=40, spread=40.0), 1, heads_first, False),  # maxima grow by far from block to block
              (dict(heads=20, latent=40, rope=8, picks=33, spread=40.0), 3, rows_first, False)]
    for seed, (shape, splits, blocks, int32) in enumerate(checks):
        spread = shape.pop("spread", 1.0)
        q_latent, q_rope, cache, slots, positions, scale, indices = case(seed, **shape)
        q_latent = q_latent * spread
        for picks in (indices.int() if int32 else indices, None):  # sparse, dense
            out = latent_attention(q_latent, q_rope, cache, slots, positions, scale, picks, splits, blocks=blocks)
            expected = latent_attention_reference(q_latent.float(), q_rope.float(), cache.float(), slots, positions,
                                                  scale, picks)
            tolerance = (1e-5 if q_latent.dtype == torch.float32 else 2e-3) * spread  # scores × spread: as their rounding
            torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
            assert out.dtype == q_latent.dtype
            if picks is not None:
                assert not out[-1].any()  # no visible pick: zeros, not NaN
    print("kernel matches")
""")


def test_kernel_under_the_triton_interpreter_matches_the_reference():
    run_interpreted(KERNEL_CHECK)


def test_splits_fill_one_wave_of_multiprocessors(monkeypatch):
    from piecewise.kernels import mla

    monkeypatch.setattr(mla, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert mla.latent_splits(1, 1, 2048, cuda) == 32  # SPLIT_PICKS picks each at least
    assert mla.latent_splits(8, 1, 2048, cuda) == 16
    assert mla.latent_splits(32, 1, 2048, cuda) == 4
    assert mla.latent_splits(128, 1, 2048, cuda) == 1  # enough programs already
    assert mla.latent_splits(2048, 4, 2048, cuda) == 1  # prefill
    assert mla.latent_splits(1, 1, 100, cuda) == 1  # too few picks to share


def _build(kernel, signature: dict, constants: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=signature | {name: "constexpr" for name in constants}, constexprs=constants)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except RuntimeError as exc:
        if "ptxas" in str(exc).lower() and "not found" in str(exc).lower():
            pytest.skip(f"no ptxas here: {exc}")
        raise


@pytest.mark.parametrize("fp8", [False, True])
def test_kernels_build_for_hopper_without_a_gpu(fp8):
    """GLM-5's shapes with the default blocks; with ``fp8`` over FP8 rows (a byte cache, ``kernels.latent_fp8``)."""
    pytest.importorskip("triton")
    from piecewise.kernels import latent_fp8, mla

    names = ["q_latent_ptr", "q_rope_ptr", "cache_ptr", "indices_ptr", "slots_ptr", "positions_ptr", "out_ptr",
             "part_ptr", "stats_ptr", "scale", "max_seq", "picks", "splits", "chunk", "stride_ql_token",
             "stride_ql_head", "stride_qr_token", "stride_qr_head", "stride_cache_slot", "stride_cache_pos",
             "stride_index_token", "stride_index_pick", "stride_out_token", "stride_out_head"]
    types = ["*bf16", "*bf16", "*u8" if fp8 else "*bf16", "*i32", "*i64", "*i64", "*bf16", "*fp32", "*fp32",
             "fp32"] + ["i32"] * 14
    blocks = mla.BLOCKS[torch.bfloat16]
    constants = {"HEADS": 64, "HEAD_BLOCKS": 64 // blocks.heads, "LATENT": 512, "ROPE": 64, "BLOCK_R": 512,
                 "BLOCK_P": 64, "BLOCK_H": blocks.heads, "BLOCK_N": blocks.rows, "SPLIT": True, "SPARSE": True,
                 "ROWS_FIRST": blocks.rows_first, "PRECISION": "tf32", "INTERPRETED": False, "FP8": fp8,
                 "TILE": latent_fp8.tile(512)}
    kernel = _build(mla._latent_attention_kernel, dict(zip(names, types)), constants)
    assert "mma" in kernel.asm["ptx"]
    names = ["part_ptr", "stats_ptr", "out_ptr", "splits", "stride_out_token", "stride_out_head"]
    constants = {"HEADS": 64, "LATENT": 512, "BLOCK_R": 512, "BLOCK_S": 8}
    assert _build(mla._combine_kernel, dict(zip(names, ["*fp32", "*fp32", "*bf16", "i32", "i32", "i32"])),
                  constants).asm["ptx"]


def test_attend_latent_runs_the_reference_on_cpu():
    args = case(3)
    torch.testing.assert_close(attend_latent(*args), latent_attention_reference(*args))
    torch.testing.assert_close(attend_latent(*args[:-1]), latent_attention_reference(*args[:-1]))


def test_kernel_wrapper_refuses_mismatched_shapes_and_dtypes():
    pytest.importorskip("triton")
    from piecewise.kernels.mla import latent_attention

    q_latent, q_rope, cache, slots, positions, scale, indices = case(4)
    with pytest.raises(ValueError, match="cache must be"):
        latent_attention(q_latent, q_rope, cache[..., :-1], slots, positions, scale, indices)
    with pytest.raises(ValueError, match="share a dtype"):
        latent_attention(q_latent, q_rope.double(), cache, slots, positions, scale, indices)
    with pytest.raises(ValueError, match="indices must be"):
        latent_attention(q_latent, q_rope, cache, slots, positions, scale, indices.float())
    with pytest.raises(ValueError, match="slots and positions"):
        latent_attention(q_latent, q_rope, cache, slots[:-1], positions, scale, indices)
