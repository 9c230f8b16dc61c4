"""The one-launch slot attention (``kernels.attention``) on CUDA against its PyTorch reference."""

import math

import pytest
import torch

from piecewise.kernels.attention import slot_attention, slot_attention_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(96, 8, 128), (32, 8, 128), (8, 8, 64), (12, 2, 80)])
@pytest.mark.parametrize("tokens", [1, 8, 67])
def test_kernel_matches_the_reference(dtype, q_heads, kv_heads, head_dim, tokens):
    generator = torch.Generator(device="cuda").manual_seed(tokens * 1000 + q_heads)
    sequences, max_seq = 80, 600
    cache_k = torch.randn(sequences, max_seq, kv_heads, head_dim, device="cuda", generator=generator).to(dtype)
    cache_v = torch.randn(sequences, max_seq, kv_heads, head_dim, device="cuda", generator=generator).to(dtype)
    slots = torch.randint(0, sequences, (tokens,), device="cuda", generator=generator)
    positions = torch.randint(0, max_seq, (tokens,), device="cuda", generator=generator)
    positions[0] = max_seq - 1
    q = torch.randn(tokens, q_heads, head_dim, device="cuda", generator=generator).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    out = slot_attention(q, cache_k, cache_v, slots, positions, scale)
    expected = slot_attention_reference(q.float(), cache_k.float(), cache_v.float(), slots, positions, scale)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [None, 2, 5, 32])
def test_keys_split_over_programs_match_the_reference(dtype, splits):
    """A long cache and few tokens (``key_splits`` picks several splits), or a forced number of splits."""
    generator = torch.Generator(device="cuda").manual_seed(7)
    cache_k = torch.randn(4, 9000, 8, 128, device="cuda", generator=generator).to(dtype)
    cache_v = torch.randn(4, 9000, 8, 128, device="cuda", generator=generator).to(dtype)
    slots = torch.tensor([3, 0, 3], device="cuda")
    positions = torch.tensor([8999, 5, 4100], device="cuda")  # the second token's keys lie in split 0 only
    q = torch.randn(3, 96, 128, device="cuda", generator=generator).to(dtype)
    out = slot_attention(q, cache_k, cache_v, slots, positions, 0.088, splits=splits)
    expected = slot_attention_reference(q.float(), cache_k.float(), cache_v.float(), slots, positions, 0.088)
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_kernel_replays_in_a_cuda_graph_with_new_slots_and_positions():
    torch.manual_seed(0)
    cache_k = torch.randn(16, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    cache_v = torch.randn_like(cache_k)
    q = torch.randn(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(8, device="cuda")
    positions = torch.full((8,), 10, device="cuda")
    slot_attention(q, cache_k, cache_v, slots, positions, 0.1)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = slot_attention(q, cache_k, cache_v, slots, positions, 0.1)
    slots.copy_(torch.randperm(16, device="cuda")[:8])
    positions.copy_(torch.randint(0, 300, (8,), device="cuda"))
    graph.replay()
    expected = slot_attention_reference(q.float(), cache_k.float(), cache_v.float(), slots, positions, 0.1)
    torch.testing.assert_close(out.float(), expected, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("tokens", [1, 13, 512, 513])
def test_one_sequence_through_attend_matches_attention_over_its_cache(tokens):
    """The single-sequence path of ``attend`` (the example models' attention op): kernel up to 512 tokens."""
    from piecewise.kernels.attention import attend, attend_over_cache

    generator = torch.Generator(device="cuda").manual_seed(tokens)
    cache_k = torch.randn(1024, 4, 64, device="cuda", generator=generator).to(torch.bfloat16)
    cache_v = torch.randn(1024, 4, 64, device="cuda", generator=generator).to(torch.bfloat16)
    q = torch.randn(tokens, 16, 64, device="cuda", generator=generator).to(torch.bfloat16)
    positions = torch.arange(tokens, device="cuda") + 300
    out = attend(q, cache_k, cache_v, positions)
    expected = attend_over_cache(q.float(), cache_k.float(), cache_v.float(), positions).view(q.shape)
    torch.testing.assert_close(out.float(), expected, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize(("window", "softcap", "splits"), [(4096, 0.0, None), (100, 0.0, 1), (1, 0.0, 3),
                                                            (0, 50.0, None), (512, 30.0, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sliding_windows_and_softcapping_match_the_reference(window, softcap, splits, dtype):
    generator = torch.Generator(device="cuda").manual_seed(window + int(softcap))
    cache_k = torch.randn(4, 9000, 8, 128, device="cuda", generator=generator).to(dtype)
    cache_v = torch.randn(4, 9000, 8, 128, device="cuda", generator=generator).to(dtype)
    slots = torch.tensor([3, 0, 3, 1], device="cuda")
    positions = torch.tensor([8999, 5, 4100, 70], device="cuda")
    q = (4 * torch.randn(4, 64, 128, device="cuda", generator=generator)).to(dtype)
    out = slot_attention(q, cache_k, cache_v, slots, positions, 0.088, window, softcap, splits=splits)
    expected = slot_attention_reference(q.float(), cache_k.float(), cache_v.float(), slots, positions, 0.088, window,
                                        softcap)
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_prefill_of_many_prompts_runs_batched_and_equals_the_reference(dtype):
    """Past KERNEL_TOKENS, ``attend`` runs one SDPA over every sequence of the call on CUDA."""
    from piecewise.kernels.attention import KERNEL_TOKENS, attend, slot_attention_reference

    torch.manual_seed(0)
    lengths = [300, 200, 180]
    cache_k, cache_v = (torch.randn(4, 512, 2, 64, device="cuda", dtype=dtype) for _ in range(2))
    slots = torch.cat([torch.full((n,), s, device="cuda") for s, n in zip((2, 0, 3), lengths)])
    positions = torch.cat([torch.arange(n, device="cuda") + (5 if s == 0 else 0) for s, n in zip((2, 0, 3), lengths)])
    q = torch.randn(sum(lengths), 8, 64, device="cuda", dtype=dtype)
    assert q.shape[0] > KERNEL_TOKENS
    out = attend(q, cache_k, cache_v, positions, 0.125, slots)
    reference = slot_attention_reference(q.float(), cache_k.float(), cache_v.float(), slots, positions, 0.125)
    torch.testing.assert_close(out.float(), reference, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)
