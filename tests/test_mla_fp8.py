"""MLA models over an FP8 latent cache (``make_kv_cache(dtype="fp8")``, ``kernels.latent_fp8``), on CPU.

The rows hold the latent in float8 e4m3 with one float32 scale per tile and the rotated key in bfloat16. What
this asserts: the rows a call writes are its latent and rotated key rounded that way (nothing else changes); a
runner over the FP8 cache equals the same model run eagerly over an FP8 cache, through slots, prefill and decode,
both front-ends, for every MLA architecture with the latent path (DSA models too); against transformers' forward
in float32 with its latent rounded to FP8 the logits differ by the rotated key's bf16 rounding only; ``verify()`` passes; wrong caches are refused with the fix.
"""

from __future__ import annotations

import contextlib
import textwrap

import pytest
import torch

import piecewise

transformers = pytest.importorskip("transformers")
from piecewise.integrations import mla  # noqa: E402
from piecewise.integrations.transformers import TokenModel, enable  # noqa: E402
from piecewise.kernels import latent_fp8  # noqa: E402
from piecewise.runtime.verify import rel_error  # noqa: E402
from piecewise.stored import values  # noqa: E402
import test_dsa  # noqa: E402
import test_mla  # noqa: E402


def build(name: str, seed: int = 0):
    return test_dsa.build(name, seed) if name in test_dsa.ARCHITECTURES else test_mla.build(name, seed)


@pytest.mark.parametrize("shape", [(512, 64), (16, 8), (256, 32)])
def test_rows_round_the_latent_per_tile_and_keep_the_rotated_key_in_bf16(shape):
    latent, rope = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, latent, generator=generator) * torch.logspace(-3, 2, latent)  # tiles of unlike ranges
    k = torch.randn(5, 3, rope, generator=generator) * 100
    rows = latent_fp8.quantize_rows(x, k)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 3, latent_fp8.row_bytes(latent, rope))
    back = latent_fp8.dequantize_rows(rows, latent, torch.float32)
    tile = latent_fp8.tile(latent)
    amax = x.reshape(5, 3, -1, tile).abs().amax(-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: each value within 2^-4 of itself, or of the tile's scale near zero
    bound = torch.maximum(x.reshape(5, 3, -1, tile).abs() / 16, amax / latent_fp8.FP8_MAX / 2).reshape(x.shape)
    assert ((back[..., :latent] - x).abs() <= bound * 1.001).all()
    assert torch.equal(back[..., latent:], k.to(torch.bfloat16).float())
    if latent == 512:
        assert rows.shape[-1] == 656  # DeepSeek's fp8_ds_mla row


def test_zero_rows_read_back_as_zeros():
    rows = latent_fp8.quantize_rows(torch.zeros(2, 16), torch.zeros(2, 8))
    assert torch.equal(latent_fp8.dequantize_rows(rows, 16, torch.float32), torch.zeros(2, 24))


@contextlib.contextmanager
def latent_rounded_to_fp8(model):
    """transformers' forward with each normalised latent rounded as an FP8 row rounds it (the whole-sequence
    reference of a cached run over an FP8 cache, but for the rotated key's bf16 rounding). Without it a tiny
    random MoE's top-k routing flips on FP8's 2% and a sequence's logits move 25%."""
    def hook(module, args, out):
        rows = out.reshape(-1, out.shape[-1])
        quantized = latent_fp8.quantize_rows(rows, rows.new_zeros(rows.shape[0], 2))
        return latent_fp8.dequantize_rows(quantized, rows.shape[-1], out.dtype)[:, :rows.shape[-1]].reshape(out.shape)

    hooks = [layer.self_attn.kv_a_layernorm.register_forward_hook(hook) for layer in model.model.layers]
    try:
        yield
    finally:
        for handle in hooks:
            handle.remove()


@pytest.mark.parametrize("name", test_mla.LATENT + ["GlmMoeDsa", "DeepseekV32"])
def test_runner_over_an_fp8_cache_equals_eager_over_one_and_transformers_within_fp8(name):
    model = build(name)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 256, (9,), generator=generator) for _ in range(3)]
    with torch.no_grad(), latent_rounded_to_fp8(model):
        expected = [model(input_ids=s[None], use_cache=False).logits[0] for s in sequences]
    token_model = TokenModel(enable(model))
    c = model.config
    cache = token_model.make_kv_cache(max_seq_len=16, sequences=3, dtype="fp8")
    width = latent_fp8.row_bytes(c.kv_lora_rank, c.qk_rope_head_dim)
    assert cache.dtype == torch.uint8 and cache.shape == (c.num_hidden_layers, 3, 16, width)
    index = sum(m.head_dim for m in test_dsa.indexers(model)) * 4 if name in test_dsa.ARCHITECTURES else 0
    assert token_model.kv_bytes_per_token("fp8") == c.num_hidden_layers * width + index
    eager_cache = cache.clone()
    with torch.no_grad():
        eager = test_mla.run_steps(token_model, sequences, eager_cache, prompt=5)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad():
        got = test_mla.run_steps(runner, sequences, cache, prompt=5)
    # the pieces' float32 rounding differs from eager's in the last bit, which can move a value to the
    # neighbouring float8 code: the same rows but for a few codes, and logits that close
    assert (cache != eager_cache).float().mean() < 1e-2
    torch.testing.assert_close(values(cache), values(eager_cache, cache), rtol=0.13, atol=1e-3)
    for logits, want, exact in zip(got, expected, eager):
        torch.testing.assert_close(logits, exact, rtol=1e-3, atol=1e-3)
        assert (logits - want).norm() / want.norm() < 1e-2  # the rotated key's bf16 rounding, nothing else


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_the_rows_written_are_the_latent_and_rotated_key_rounded_and_nothing_else(frontend):
    """Layer 0's rows are the quantized rows of a float32 cache's; every layer's are eager's over an FP8 cache (a
    later layer's latent follows the FP8 attention before it); rows past the tokens keep their bytes."""
    model = build("DeepseekV3", seed=3)
    token_model = TokenModel(enable(model))
    ids = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(4))
    wide = token_model.make_kv_cache(max_seq_len=12)
    eager = token_model.make_kv_cache(max_seq_len=12, dtype="fp8")
    with torch.no_grad():
        token_model(ids, torch.arange(7), wide)
        token_model(ids[:6], torch.arange(6), eager)
        token_model(ids[6:], torch.tensor([6]), eager)
    cache = token_model.make_kv_cache(max_seq_len=12, dtype=torch.float8_e4m3fn)
    cache.random_(0, 256)
    before = cache.clone()
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad():
        runner(ids[:6], torch.arange(6), cache)
        runner(ids[6:], torch.tensor([6]), cache)
    r = model.config.kv_lora_rank
    rounded = latent_fp8.dequantize_rows(latent_fp8.quantize_rows(wide[0, :7, :r], wide[0, :7, r:]), r, torch.float32)
    # the same values but for one here and there at the neighbouring float8 code (float32's last bit differs)
    assert rel_error(latent_fp8.dequantize_rows(cache[0, :7], r, torch.float32), rounded) < 1e-2
    assert rel_error(values(cache[:, :7], cache).float(), values(eager[:, :7], cache).float()) < 1e-2
    assert torch.equal(cache[:, 7:], before[:, 7:]), "rows past the tokens changed"


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_verify_passes_at_every_size_over_an_fp8_cache(frontend):
    token_model = TokenModel(enable(build("GlmMoeDsa")))
    cache = token_model.make_kv_cache(max_seq_len=24, dtype="fp8")
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))

    def make_inputs(tokens):
        return (torch.randint(0, 256, (tokens,)), torch.arange(6, 6 + tokens), cache)

    with torch.no_grad():
        runner(torch.randint(0, 256, (6,)), torch.arange(6), cache)
        report = runner.verify(*make_inputs(3), make_inputs=make_inputs)
    assert report.ok, report


def test_long_dense_calls_read_fp8_rows_through_the_up_projection(monkeypatch):
    model = build("DeepseekV3", seed=2)
    token_model = TokenModel(enable(model))
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(5))
    latent_cache = token_model.make_kv_cache(max_seq_len=12, dtype="fp8")
    with torch.no_grad():
        absorbed = token_model(ids, torch.arange(9), latent_cache)
        monkeypatch.setattr(mla, "UP_PROJECT_TOKENS", 4)
        projected_cache = token_model.make_kv_cache(max_seq_len=12, dtype="fp8")
        projected = token_model(ids, torch.arange(9), projected_cache)
    torch.testing.assert_close(values(projected_cache), values(latent_cache), rtol=0.13, atol=1e-3)
    torch.testing.assert_close(projected, absorbed, rtol=1e-4, atol=1e-4)


def test_fp8_caches_the_model_cannot_read_are_refused_with_the_fix():
    per_head = TokenModel(enable(test_mla.build("DeepseekV2")))
    with pytest.raises(ValueError, match="MLA models' latent cache only"):
        per_head.make_kv_cache(8, dtype="fp8")
    token_model = TokenModel(enable(build("DeepseekV3")))
    wrong = torch.zeros(2, 8, 30, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"FP8 rows: uint8 \[\.\.\., 36\]"):
        token_model(torch.tensor([1]), torch.tensor([0]), wrong)
    with pytest.raises(ValueError, match="dtype torch.int32.*make_kv_cache"):
        token_model(torch.tensor([1]), torch.tensor([0]), torch.zeros(2, 8, 24, dtype=torch.int32))


FP8_KERNEL_CHECK = textwrap.dedent("""
    import torch
    from piecewise.kernels import latent_fp8
    from piecewise.kernels.mla import LatentBlocks, latent_attention, latent_attention_reference
    from test_mla_kernel import case

    small = LatentBlocks(heads=16, warps=4, stages=1, rows=16, dense_stages=1)
    for seed, (shape, splits) in enumerate([(dict(latent=256, rope=16, heads=4), 1),
                                            (dict(latent=32, rope=8, heads=3, max_seq=20, picks=20), 2)]):
        q_latent, q_rope, cache, slots, positions, scale, indices = case(seed, **shape)
        rows = latent_fp8.quantize_rows(cache[..., :shape["latent"]], cache[..., shape["latent"]:])
        for picks in (indices, None):  # sparse, dense
            out = latent_attention(q_latent, q_rope, rows, slots, positions, scale, picks, splits, blocks=small)
            expected = latent_attention_reference(q_latent, q_rope, rows, slots, positions, scale, picks)
            # the reference over the rows read back: the kernel reads the same values
            wide = latent_fp8.dequantize_rows(rows, shape["latent"], torch.float32)
            assert torch.equal(expected, latent_attention_reference(q_latent, q_rope, wide, slots, positions, scale,
                                                                    picks))
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    print("kernel matches")
""")


def test_the_kernel_reads_fp8_rows_as_the_reference_does_under_the_triton_interpreter():
    """Codes times their tile's scale (two tiles of 128 and one whole-latent tile), the rotated key from its
    bfloat16: the kernel over the bytes equals the reference over the rows read back."""
    from test_attention_kernel import run_interpreted

    run_interpreted(FP8_KERNEL_CHECK)

