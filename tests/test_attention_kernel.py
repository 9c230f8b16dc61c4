"""The one-launch attention over a multi-sequence KV cache (``kernels.attention``) on CPU: its reference against
attention written out per token, the Triton kernel under the interpreter against the reference, its sm_90 build."""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from piecewise.kernels.attention import slot_attention_reference

SRC = str(Path(__file__).resolve().parents[1] / "src")


def per_token(q, cache_k, cache_v, slots, positions, scale, window=0, softcap=0.0):
    """Each query head of each token over keys 0..position of its sequence (the last ``window`` of them), with
    an explicit (soft-capped) softmax."""
    group = q.shape[1] // cache_k.shape[2]
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        first = max(0, int(positions[t]) - window + 1) if window else 0
        keys = cache_k[slots[t], first : positions[t] + 1].double()
        values = cache_v[slots[t], first : positions[t] + 1].double()
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ q[t, h].double() * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[t, h] = (torch.softmax(scores, dim=0) @ values[:, h // group]).to(q.dtype)
    return out


def case(seed, sequences=4, max_seq=70, kv_heads=2, group=3, head_dim=32, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(sequences, max_seq, kv_heads, head_dim, generator=generator).to(dtype)
    cache_v = torch.randn(sequences, max_seq, kv_heads, head_dim, generator=generator).to(dtype)
    # decode tokens of two sequences, three prefill tokens of another (positions 0, 63, 64: block edges), the last key
    slots = torch.tensor([2, 0, 0, 0, 3, 1])
    positions = torch.tensor([max_seq - 1, 0, 63, 64, 33, 5])
    q = torch.randn(len(slots), kv_heads * group, head_dim, generator=generator).to(dtype)
    return q, cache_k, cache_v, slots, positions, 1 / math.sqrt(head_dim)


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (5, 0.0), (1, 0.0), (0, 2.0), (70, 1.5)])
def test_reference_is_causal_attention_of_each_token_over_its_own_sequence(window, softcap):
    args = case(0)
    torch.testing.assert_close(slot_attention_reference(*args, window, softcap), per_token(*args, window, softcap),
                               rtol=1e-5, atol=1e-5)


def test_reference_ignores_keys_past_each_position_and_other_sequences():
    q, cache_k, cache_v, slots, positions, scale = case(1)
    expected = slot_attention_reference(q, cache_k, cache_v, slots, positions, scale)
    noisy_k, noisy_v = cache_k.clone(), cache_v.clone()
    for slot in range(cache_k.shape[0]):
        used = positions[slots == slot]
        last = int(used.max()) + 1 if used.numel() else 0
        noisy_k[slot, last:] = 1e4
        noisy_v[slot, last:] = -1e4
    torch.testing.assert_close(slot_attention_reference(q, noisy_k, noisy_v, slots, positions, scale), expected)


KERNEL_CHECK = textwrap.dedent("""
    import math, torch
    from piecewise.kernels.attention import slot_attention, slot_attention_reference
    from test_attention_kernel import case
    shapes = [dict(), dict(kv_heads=1, group=12, head_dim=64), dict(kv_heads=4, group=1, head_dim=80),
              dict(dtype=torch.float16)]
    # keys split over programs (a split holding no key of a token included), then combined
    splits = [dict(max_seq=200, splits=3), dict(max_seq=300, splits=4, dtype=torch.float16, group=12, kv_heads=1),
              dict(max_seq=130, splits=7)]
    # sliding windows (within a block, across blocks and splits) and soft-capped scores
    variants = [dict(window=5), dict(window=1, splits=2, max_seq=200), dict(window=70, splits=3, max_seq=200),
                dict(softcap=2.0), dict(window=100, softcap=1.5, splits=4, max_seq=300, dtype=torch.float16)]
    for seed, shape in enumerate(shapes + splits + variants):
        split, window, softcap = shape.pop("splits", 1), shape.pop("window", 0), shape.pop("softcap", 0.0)
        q, cache_k, cache_v, slots, positions, scale = case(seed, **shape)
        out = slot_attention(q, cache_k, cache_v, slots, positions, scale, window, softcap, splits=split)
        expected = slot_attention_reference(q.float(), cache_k.float(), cache_v.float(), slots, positions, scale,
                                            window, softcap)
        tolerance = 1e-5 if q.dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
        assert out.dtype == q.dtype
    print("kernel matches")
""")

def run_interpreted(check: str) -> None:
    """Run the script ``check`` in a process under ``TRITON_INTERPRET=1`` (the tests' folder importable); it must
    print "kernel matches"."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")  # the interpreter runs on NumPy
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([SRC, str(Path(__file__).parent)]))
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernel matches" in done.stdout


def test_kernel_under_the_triton_interpreter_matches_the_reference():
    run_interpreted(KERNEL_CHECK)


def test_key_splits_only_for_few_tokens_over_a_long_cache(monkeypatch):
    from piecewise.kernels import attention

    monkeypatch.setattr(attention, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert attention.key_splits(1, 8, 513, cuda) == 1  # a short cache: one launch
    assert attention.key_splits(1, 8, 8192, cuda) == 8  # 1024 positions per split at least
    assert attention.key_splits(4, 8, 65536, cuda) == 9  # two programs per multiprocessor
    assert attention.key_splits(32, 8, 65536, cuda) == 1  # enough programs already


def _build(kernel, signature: dict, constants: dict):
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=signature | {name: "constexpr" for name in constants}, constexprs=constants)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except RuntimeError as exc:
        if "ptxas" in str(exc).lower() and "not found" in str(exc).lower():
            pytest.skip(f"no ptxas here: {exc}")
        raise


@pytest.mark.parametrize("splits", [1, 8])
def test_kernels_build_for_hopper_without_a_gpu(splits):
    pytest.importorskip("triton")
    from piecewise.kernels import attention

    names = ["q_ptr", "k_ptr", "v_ptr", "out_ptr", "part_ptr", "stats_ptr", "slots_ptr", "positions_ptr", "scale",
             "window", "softcap", "stride_q_token", "stride_q_head", "stride_k_slot", "stride_k_pos", "stride_k_head", "stride_v_slot",
             "stride_v_pos", "stride_v_head", "stride_out_token", "stride_out_head"]
    types = ["*bf16"] * 4 + ["*fp32", "*fp32", "*i64", "*i64", "fp32", "i32", "fp32"] + ["i32"] * 10
    constants = {"Q_HEADS": 96, "GROUP": 12, "BLOCK_G": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_N": 64,
                 "SPLITS": splits, "CHUNK": 1024, "PRECISION": "tf32", "INTERPRETED": False,
                 "WINDOW": splits > 1, "SOFTCAP": splits > 1}
    kernel = _build(attention._slot_attention_kernel, dict(zip(names, types)), constants)
    assert "mma" in kernel.asm["ptx"]
    if splits > 1:
        names = ["part_ptr", "stats_ptr", "out_ptr", "stride_out_token", "stride_out_head"]
        constants = {"Q_HEADS": 96, "HEAD_DIM": 128, "BLOCK_D": 128, "SPLITS": splits, "BLOCK_S": 8}
        assert _build(attention._combine_kernel, dict(zip(names, ["*fp32", "*fp32", "*bf16", "i32", "i32"])),
                      constants).asm["ptx"]


def test_attend_runs_the_reference_on_cpu_for_one_sequence_and_for_slots():
    from piecewise.kernels.attention import attend, attend_over_cache

    q, cache_k, cache_v, slots, positions, scale = case(5)
    torch.testing.assert_close(attend(q, cache_k, cache_v, positions, scale, slots),
                               slot_attention_reference(q, cache_k, cache_v, slots, positions, scale))
    one = attend(q, cache_k[1], cache_v[1], positions, scale)
    torch.testing.assert_close(one, attend_over_cache(q, cache_k[1], cache_v[1], positions, scale).view(q.shape))


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("q_heads", [2, 8])
def test_batched_slot_attention_equals_the_reference_for_interleaved_sequences(window, q_heads):
    """A long prefill of several prompts runs as one SDPA (``slot_attention_batched``): sequences of different
    lengths and starts, their tokens interleaved in the call, with and without grouped heads and a window."""
    from piecewise.kernels.attention import slot_attention_batched

    generator = torch.Generator().manual_seed(q_heads + window)
    cache_k, cache_v = (torch.randn(5, 40, 2, 16, generator=generator) for _ in range(2))
    slots = torch.cat([torch.full((7,), 3), torch.full((3,), 1), torch.full((20,), 4)])
    positions = torch.cat([torch.arange(7), torch.arange(10, 13), torch.arange(20)])
    order = torch.randperm(30, generator=generator)
    slots, positions = slots[order], positions[order]
    q = torch.randn(30, q_heads, 16, generator=generator)
    torch.testing.assert_close(slot_attention_batched(q, cache_k, cache_v, slots, positions, 0.25, window),
                               slot_attention_reference(q, cache_k, cache_v, slots, positions, 0.25, window))
    fresh = positions.clone()  # every sequence from position 0: the causal path without a mask
    for slot in (3, 1, 4):
        fresh[slots == slot] = torch.arange(int((slots == slot).sum()))
    torch.testing.assert_close(slot_attention_batched(q, cache_k, cache_v, slots, fresh, 0.25, window),
                               slot_attention_reference(q, cache_k, cache_v, slots, fresh, 0.25, window))


@pytest.mark.parametrize("start", [0, 6])
@pytest.mark.parametrize("order", [(0, 2, 3), (2, 0, 3)])  # ascending slots: the batch is a view of the rows
def test_batched_slot_attention_reads_a_calls_layout_once_for_every_layer(start, order, monkeypatch):
    """Within ``one_layout_per_call`` (each ``TokenModel`` call) the call's layout is read from the device once
    and reused by every layer: prompts of equal length one after another (in ascending slots the batch is a view
    of the rows, its output contiguous), from position 0 or a later chunk, layers of their own caches and
    alternating sliding windows."""
    from piecewise.kernels import attention as kernels

    generator = torch.Generator().manual_seed(start)
    slots = torch.tensor(order).repeat_interleave(8)
    positions = (torch.arange(8) + start).repeat(3)
    q = torch.randn(4, 24, 16, generator=generator).transpose(0, 1)  # token-major view, as the integration's
    layers = [[torch.randn(4, 20, 2, 16, generator=generator) for _ in range(2)] for _ in range(4)]
    reads = []
    unique = torch.unique
    monkeypatch.setattr(torch, "unique", lambda *a, **k: reads.append(1) or unique(*a, **k))
    with kernels.one_layout_per_call():
        got = [kernels.slot_attention_batched(q, k, v, slots, positions, 0.25, window=3 * (i % 2))
               for i, (k, v) in enumerate(layers)]
    assert len(reads) == 1 and all(out.is_contiguous() for out in got)
    assert kernels._layout(slots, positions)["packed"] == (list(order) == sorted(order))
    for i, (k, v) in enumerate(layers):
        torch.testing.assert_close(got[i], slot_attention_reference(q, k, v, slots, positions, 0.25, 3 * (i % 2)))
    reads.clear()
    kernels.slot_attention_batched(q, *layers[0], slots, positions, 0.25)
    kernels.slot_attention_batched(q, *layers[0], slots, positions, 0.25)
    assert len(reads) == 2  # outside it: read at every call (the tensors may have changed in between)
