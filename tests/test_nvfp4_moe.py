"""The static-shape NVFP4 MoE on CPU: the expert alignment, the grouped kernel's index arithmetic (emulated), its
sm_90 build, and the op inside piecewise pieces."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import piecewise
from piecewise.kernels.nvfp4 import dequantize, global_scale_for, quantize
from piecewise.kernels.nvfp4.moe import BLOCK_M, align, moe_nvfp4_reference
from piecewise.kernels.nvfp4.moe import moe_op


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 40), top_k=st.integers(1, 8), experts=st.sampled_from([4, 16, 128]),
       seed=st.integers(0, 2**16))
def test_align_groups_every_pair_by_expert_in_whole_blocks(tokens, top_k, experts, seed):
    generator = torch.Generator().manual_seed(seed)
    top_k = min(top_k, experts)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    rows, block_expert = align(ids, experts)
    pairs = tokens * top_k
    blocks = -(-pairs // BLOCK_M) + experts
    assert rows.shape == (blocks * BLOCK_M,) and block_expert.shape == (blocks,)
    valid = rows[rows < pairs]
    assert sorted(valid.tolist()) == list(range(pairs))  # every pair exactly once, the rest padding
    assert torch.all(rows[rows >= pairs] == pairs)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=experts)
    used = int(((counts + BLOCK_M - 1) // BLOCK_M).sum())
    assert torch.all(block_expert[used:] == -1) and torch.all(block_expert[:used] >= 0)
    assert torch.all(block_expert[:used][1:] >= block_expert[:used][:-1])  # experts in order
    for block in range(used):
        members = rows[block * BLOCK_M : (block + 1) * BLOCK_M]
        members = members[members < pairs]
        assert len(members) > 0 and torch.all(flat[members] == block_expert[block])


def random_experts(experts=6, hidden=64, inter=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in (("gate_up", (experts, 2 * inter, hidden)), ("down", (experts, hidden, inter))):
        dense = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        parts = [quantize(w, global_scale_for(w)) for w in dense]
        tensors[name] = torch.stack([p for p, _ in parts])
        tensors[name + "_scale"] = torch.stack([s for _, s in parts])
        tensors[name + "_scale_2"] = torch.stack([1 / global_scale_for(w) for w in dense]).float()
    return tensors


def emulate_grouped(x, ids, weights, t):
    """The two grouped launches of moe_nvfp4_cuda, block by block in torch: the kernel's index arithmetic."""
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    rows, block_expert = align(ids, t["gate_up"].shape[0])

    def launch(inputs, name, x_row_div, route=None):
        out = torch.full((pairs, t[name].shape[1]), float("nan"))
        for block, expert in enumerate(block_expert.tolist()):
            if expert < 0:
                continue
            p = rows[block * BLOCK_M : (block + 1) * BLOCK_M]
            p = p[p < pairs]
            w = dequantize(t[name][expert], t[name + "_scale"][expert], torch.ones(()), dtype=torch.float32)
            value = inputs[p // x_row_div] @ w.T * t[name + "_scale_2"][expert]
            out[p] = value * route[p, None] if route is not None else value
        return out

    gate, up = launch(x, "gate_up", top_k).chunk(2, dim=-1)
    routed = launch(F.silu(gate) * up, "down", 1, route=weights.reshape(-1))
    return routed.view(tokens, top_k, -1).sum(dim=1)


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 3), (40, 4)])
def test_the_grouped_launches_compute_the_routed_sum(tokens, top_k):
    t = random_experts()
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=generator)
    ids = torch.stack([torch.randperm(6, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    expected = moe_nvfp4_reference(x, ids, weights, *t.values())
    torch.testing.assert_close(emulate_grouped(x, ids, weights, t), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe_op(x, ids, weights, *t.values()), expected)  # the op's CPU path


@pytest.mark.parametrize("halves", [False, True])  # one decode scale per expert, or one per gate/up half
def test_grouped_kernel_builds_for_hopper_without_a_gpu(halves):
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from piecewise.kernels.nvfp4 import moe

    names = ["x_ptr", "weight_ptr", "scales_ptr", "decode_ptr", "route_ptr", "out_ptr", "rows_ptr", "block_expert_ptr",
             "pairs", "out_features", "in_features", "stride_x_row", "stride_out_row", "x_row_div"]
    types = ["*bf16", "*u8", "*u8", "*fp32", "*fp32", "*fp32", "*i64", "*i64"] + ["i32"] * 6
    constants = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "IS_FP16": False, "APPLY_ROUTE": True,
                 "HALVES": halves}
    signature = dict(zip(names, types)) | {name: "constexpr" for name in constants}
    source = ASTSource(fn=moe._grouped_kernel, signature=signature, constexprs=constants)
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    except RuntimeError as exc:
        if "ptxas" in str(exc).lower() and "not found" in str(exc).lower():
            pytest.skip(f"no ptxas here: {exc}")
        raise
    ptx = kernel.asm["ptx"]
    assert "wgmma" in ptx or "mma.sync" in ptx


def test_grouped_nvfp4_experts_stay_inside_the_pieces():
    from piecewise.models.glm_moe import example, quantize_experts

    model, (ids, positions, cache) = example(tokens=7, num_layers=3, hidden_size=64, moe_intermediate_size=32)
    quantize_experts(model, grouped=True)
    expected = model(ids, positions, model.make_kv_cache())
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad():
        torch.testing.assert_close(runner(ids, positions, cache), expected, rtol=1e-5, atol=1e-5)
    assert runner.stats["pieces"] == 3 + 1  # cut at attention only
