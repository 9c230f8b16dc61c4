"""The GLM-style MoE model on CUDA: captured pieces around the eager experts, bf16 and NVFP4 weights.

MoE routing is discontinuous: two experts' scores a rounding apart can swap under a different kernel or padded
shape. So captured graphs are compared with the same runner's padded calls without graphs (the same kernels,
which must agree to rounding), and the model's eager forward is the reference only in float32."""

import pytest
import torch

import piecewise
from piecewise.kernels.nvfp4 import quantize_linears
from piecewise.models.glm_moe import example, quantize_experts

pytestmark = pytest.mark.gpu

CONFIG = dict(num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, moe_intermediate_size=128,
              num_experts=16, top_k=4, n_group=4, topk_group=2)


def rel_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def outputs(model, cache, ids, positions, cuda_graphs):
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=32, cuda_graphs=cuda_graphs))
    results = {}
    with torch.no_grad():
        for tokens in (16, 1, 5, 32):
            cache.zero_()
            results[tokens] = runner(ids[:tokens], positions[:tokens], cache)
    return results, runner.stats


@pytest.mark.parametrize("weights", ["bf16", "nvfp4", "nvfp4-grouped"])
def test_glm_moe_graphs_replay_what_the_padded_pieces_compute(weights):
    model, (ids, positions, cache) = example(tokens=32, device="cuda", dtype=torch.bfloat16, **CONFIG)
    if weights != "bf16":
        assert quantize_experts(model, grouped=weights == "nvfp4-grouped") == 2
        quantize_linears(model, skip=("lm_head", "router"))
    captured, stats = outputs(model, cache, ids, positions, cuda_graphs=True)
    plain, _ = outputs(model, torch.zeros_like(cache), ids, positions, cuda_graphs=False)
    for tokens in captured:
        assert rel_error(captured[tokens], plain[tokens]) <= 1e-3, tokens
    assert stats["cuda_graphs"] is True and stats["replays"] > 0
    assert stats["pieces"] == (4 if weights == "nvfp4-grouped" else 3 + 2 + 1)


def test_glm_moe_float32_captured_equals_eager():
    model, (ids, positions, cache) = example(tokens=32, device="cuda", dtype=torch.float32, **CONFIG)
    captured, _ = outputs(model, cache, ids, positions, cuda_graphs=True)
    with torch.no_grad():
        for tokens, out in captured.items():
            assert rel_error(out, model(ids[:tokens], positions[:tokens], model.make_kv_cache())) <= 1e-4, tokens
