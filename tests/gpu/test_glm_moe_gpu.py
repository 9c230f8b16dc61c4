"""The GLM-style MoE model on CUDA: captured pieces around the eager experts, bf16 and NVFP4 weights."""

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


@pytest.mark.parametrize("nvfp4", [False, True], ids=["bf16", "nvfp4"])
def test_glm_moe_captured_pieces_equal_eager(nvfp4):
    model, (ids, positions, cache) = example(tokens=16, device="cuda", dtype=torch.bfloat16, **CONFIG)
    if nvfp4:
        assert quantize_experts(model) == 2
        quantize_linears(model, skip=("lm_head", "router"))
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=32))
    with torch.no_grad():
        for tokens in (16, 1, 5, 32):
            ids = torch.randint(0, model.config.vocab_size, (tokens,), device="cuda")
            positions = torch.arange(tokens, device="cuda")
            cache.zero_()
            out = runner(ids, positions, cache)
            ref = model(ids, positions, model.make_kv_cache())
            assert rel_error(out, ref) <= 1e-2, (tokens, rel_error(out, ref))
    stats = runner.stats
    assert stats["cuda_graphs"] is True and stats["pieces"] == 3 + 2 + 1
    assert stats["graphs"] == 6 * len(stats["captured_sizes"])
