"""The static-shape NVFP4 MoE on CUDA: grouped kernels against the per-expert loop, inside a CUDA graph."""

import pytest
import torch

import piecewise
from piecewise.kernels.nvfp4 import global_scale_for, quantize
from piecewise.kernels.nvfp4.moe import moe_nvfp4_reference
from piecewise.kernels.nvfp4.moe import moe_op

pytestmark = pytest.mark.gpu


def rel_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def random_experts(experts, hidden, inter, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    tensors = []
    for shape in ((experts, 2 * inter, hidden), (experts, hidden, inter)):
        dense = torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16) / shape[-1] ** 0.5
        parts = [quantize(w, global_scale_for(w)) for w in dense]
        tensors += [torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts]),
                    torch.stack([1 / global_scale_for(w) for w in dense]).float()]
    return tensors


def routing(tokens, top_k, experts, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=generator, device="cuda").topk(top_k, dim=-1).indices
    return ids, torch.rand(tokens, top_k, generator=generator, device="cuda")


@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter", [
    (1, 8, 128, 512, 256), (7, 4, 16, 256, 128), (64, 8, 128, 512, 192), (300, 2, 8, 384, 1408 // 4)])
def test_grouped_kernels_match_the_per_expert_loop(tokens, top_k, experts, hidden, inter):
    weights_ = random_experts(experts, hidden, inter)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids, route = routing(tokens, top_k, experts, seed=tokens)
    expected = moe_nvfp4_reference(x, ids, route, *weights_)
    assert rel_error(moe_op(x, ids, route, *weights_), expected) <= 1e-2


def test_grouped_moe_replays_in_a_cuda_graph_with_new_routing():
    weights_ = random_experts(32, 256, 128)
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    ids, route = routing(4, 4, 32, seed=1)
    moe_op(x, ids, route, *weights_)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_op(x, ids, route, *weights_)
    for seed in (2, 3):
        new_ids, new_route = routing(4, 4, 32, seed=seed)
        ids.copy_(new_ids)
        route.copy_(new_route)
        graph.replay()
        assert rel_error(out, moe_nvfp4_reference(x, ids, route, *weights_)) <= 1e-2


def test_grouped_nvfp4_experts_captured_in_a_glm_moe_model():
    from piecewise.models.glm_moe import example, quantize_experts

    model, (ids, positions, cache) = example(tokens=16, device="cuda", dtype=torch.bfloat16, num_layers=3,
                                              hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                                              moe_intermediate_size=128, num_experts=16, top_k=4, n_group=4,
                                              topk_group=2)
    quantize_experts(model, grouped=True)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=32))
    with torch.no_grad():
        for tokens in (16, 1, 5):
            cache.zero_()
            out = runner(ids[:tokens], positions[:tokens], cache)
            ref = model(ids[:tokens], positions[:tokens], model.make_kv_cache())
            assert rel_error(out, ref) <= 1e-2, tokens
    assert runner.stats["pieces"] == 4 and runner.stats["replays"] > 0
