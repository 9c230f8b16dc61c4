"""The structural variants of the MLA latent-attention kernel (``LatentBlocks.values``: output columns split over
programs; ``LatentBlocks.ahead``: the next row block's scores before the current block's p·V) on CPU: under the
Triton interpreter against the PyTorch reference, sparse and dense, one split and several, 16 and 64 heads,
float32 and bfloat16, with invalid picks and a token that sees no row; their sm_90 build."""

import textwrap

import pytest
from test_attention_kernel import run_interpreted
from test_mla_kernel import _build, case

from piecewise.kernels.mla import LatentBlocks

VARIANTS_CHECK = textwrap.dedent("""
    import torch
    from piecewise.kernels.mla import LatentBlocks, latent_attention, latent_attention_reference
    from test_mla_kernel import case

    small = dict(warps=4, stages=1, rows=16)
    # shape, splits, blocks; every case: sparse (picks -3 .. past the cache, the last token seeing none) and dense
    checks = [(dict(latent=64, max_seq=40), 1, LatentBlocks(heads=16, values=2, **small)),
              (dict(latent=64, max_seq=20, picks=20), 2, LatentBlocks(heads=16, values=4, **small)),
              (dict(latent=32, heads=64, max_seq=20, picks=20), 2, LatentBlocks(heads=64, values=2, **small)),
              (dict(latent=64, heads=20, rope=8, max_seq=20, picks=20), 1,
               LatentBlocks(heads=16, values=2, rows_first=True, **small)),  # masked heads and rope
              (dict(latent=64), 1, LatentBlocks(heads=16, ahead=True, **small)),
              (dict(latent=48, heads=64, max_seq=20, picks=20), 3,
               LatentBlocks(heads=64, values=2, ahead=True, **small)),  # 48 of 64 columns: value program 1 masked
              (dict(latent=64, max_seq=20, picks=20, dtype=torch.float16), 2,
               LatentBlocks(heads=16, values=4, ahead=True, **small)),
              (dict(latent=64, max_seq=40, picks=40, spread=40.0), 1,
               LatentBlocks(heads=16, values=2, ahead=True, **small))]  # maxima grow by far from block to block
    for seed, (shape, splits, blocks) in enumerate(checks):
        spread = shape.pop("spread", 1.0)
        q_latent, q_rope, cache, slots, positions, scale, indices = case(seed, **shape)
        q_latent = q_latent * spread
        for picks in (indices, None):  # sparse, dense
            out = latent_attention(q_latent, q_rope, cache, slots, positions, scale, picks, splits, blocks=blocks)
            expected = latent_attention_reference(q_latent.float(), q_rope.float(), cache.float(), slots, positions,
                                                  scale, picks)
            tolerance = (1e-4 if q_latent.dtype == torch.float32 else 2e-3) * spread
            torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance,
                                       msg=lambda message: f"check {seed}: {message}")
            assert out.dtype == q_latent.dtype
            if picks is not None:
                assert not out[-1].any()  # no visible pick: zeros, not NaN
    print("kernel matches")
""")


def test_variants_under_the_triton_interpreter_match_the_reference():
    run_interpreted(VARIANTS_CHECK)


@pytest.mark.parametrize("values", [0, 3, 4])
def test_value_programs_need_a_power_of_2_that_leaves_16_columns_each(values):
    pytest.importorskip("triton")
    from piecewise.kernels.mla import latent_attention

    q_latent, q_rope, cache, slots, positions, scale, indices = case(0, latent=32)  # 32 columns: at most 2 programs
    with pytest.raises(ValueError, match="blocks.values"):
        latent_attention(q_latent, q_rope, cache, slots, positions, scale, indices, 1,
                         blocks=LatentBlocks(heads=16, values=values))


@pytest.mark.parametrize("fp8", [False, True])
def test_variants_build_for_hopper_without_a_gpu(fp8):
    """Values and ahead at GLM-5's shapes; with ``fp8`` over FP8 rows (a byte cache, ``kernels.latent_fp8``)."""
    pytest.importorskip("triton")
    from piecewise.kernels import mla

    names = ["q_latent_ptr", "q_rope_ptr", "cache_ptr", "indices_ptr", "slots_ptr", "positions_ptr", "out_ptr",
             "part_ptr", "stats_ptr", "scale", "max_seq", "picks", "splits", "chunk", "stride_ql_token",
             "stride_ql_head", "stride_qr_token", "stride_qr_head", "stride_cache_slot", "stride_cache_pos",
             "stride_index_token", "stride_index_pick", "stride_out_token", "stride_out_head"]
    types = ["*bf16"] * 3 + ["*i32", "*i64", "*i64", "*bf16", "*fp32", "*fp32", "fp32"] + ["i32"] * 14
    constants = {"HEADS": 64, "HEAD_BLOCKS": 1, "LATENT": 512, "ROPE": 64, "BLOCK_R": 512, "BLOCK_P": 64,
                 "BLOCK_H": 64, "BLOCK_N": 32, "SPLIT": True, "SPARSE": True, "ROWS_FIRST": False,
                 "PRECISION": "tf32", "INTERPRETED": False, "VALUES": 2, "AHEAD": True, "FP8": fp8, "TILE": 128}
    if fp8:
        types[2] = "*u8"
    kernel = _build(mla._latent_attention_variant_kernel, dict(zip(names, types)), constants)
    assert "mma" in kernel.asm["ptx"]
