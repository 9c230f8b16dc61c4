"""Tensor parallelism on CPU for mixture-of-experts models: a transformers GLM-MoE and the bundled GLM-style MoE
on two gloo ranks (attention, MLPs, shared and routed experts sharded), equal to the whole model. The ranks'
harness (spawned interpreters, timeouts, gloo's threads checked, one spawn for the module's tests) is
``test_parallel``'s."""

import pytest
import torch

import piecewise
from piecewise.kernels.nvfp4 import quantize_linears
from test_parallel import expect_case, gloo_rank, rel_error, shared_ranks


def _transformers_worker(rank: int, init_file: str, nvfp4: bool) -> None:
    import transformers

    from piecewise.integrations.transformers import TokenModel, enable, quantize
    from piecewise.integrations.transformers import tensor_parallel as hf_tensor_parallel

    with gloo_rank(rank, init_file):
        torch.manual_seed(0)
        config = transformers.Glm4MoeConfig(
            vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True)
        model = transformers.Glm4MoeForCausalLM(config).eval()
        for module in model.modules():
            if hasattr(module, "gate_up_proj"):
                torch.nn.init.normal_(module.gate_up_proj, std=0.1)
                torch.nn.init.normal_(module.down_proj, std=0.1)
            if type(module).__name__ == "Glm4MoeTopkRouter":
                # spread the router scores: the sharded sums round differently, and a near tie between two
                # experts' scores would flip the choice (transformers' default init makes every score ~0.5)
                torch.nn.init.normal_(module.weight, std=0.5)
        ids = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(1))
        token_model = TokenModel(enable(model, experts=True))
        if nvfp4:
            quantize(model, grouped_experts=True)  # before sharding: the shards partition the same bytes
        with torch.no_grad():
            expected = token_model(ids, torch.arange(9))
        sharded = hf_tensor_parallel(model)
        assert "model.layers.1.mlp.shared_experts.down_proj" in sharded and "model.layers.0.self_attn.q_proj" in sharded
        assert "model.layers.1.mlp.experts" in sharded
        experts = model.model.layers[1].mlp.experts
        stacked = experts.nvfp4.down if nvfp4 else experts.down_proj
        assert stacked.shape[-1] == (16 // 2 if nvfp4 else 16)  # half of the 32 intermediate columns (packed)
        cache = token_model.make_kv_cache(max_seq_len=16)
        assert cache.shape[3] == 1  # this rank's KV head
        runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=8))
        with torch.no_grad():
            prompt = runner(ids[:6], torch.arange(6), cache)
            assert rel_error(prompt, expected[:6]) <= 1e-5
            for position in range(6, 9):
                step = runner(ids[position : position + 1], torch.tensor([position]), cache)
                assert rel_error(step[0], expected[position]) <= 1e-5, position


@pytest.fixture(scope="module")
def ranks(request, tmp_path_factory):
    return shared_ranks(request, tmp_path_factory.mktemp("ranks"), {
        "test_a_transformers_glm_moe_on_two_ranks_equals_the_whole_model":
            lambda nvfp4: (_transformers_worker, (nvfp4,)),
        "test_the_glm_moe_example_on_two_ranks_equals_the_whole_model":
            lambda nvfp4, in_graph: (_glm_moe_worker, (nvfp4, in_graph))})


@pytest.mark.parametrize("nvfp4", [False, True], ids=["fp32", "nvfp4-grouped-experts"])
def test_a_transformers_glm_moe_on_two_ranks_equals_the_whole_model(nvfp4, request):
    """Attention, MLPs, shared and routed experts sharded; prefill and decode steps equal the whole model."""
    pytest.importorskip("transformers")
    expect_case(request.getfixturevalue("ranks"), request)


def _glm_moe_worker(rank: int, init_file: str, nvfp4: bool, in_graph: bool) -> None:
    from piecewise.models.glm_moe import GlmMoE, example, quantize_experts, tensor_parallel_glm_moe

    with gloo_rank(rank, init_file):
        model, (ids, positions, _) = example(tokens=7, num_layers=3, hidden_size=64, moe_intermediate_size=32)
        for module in model.modules():
            if isinstance(module, GlmMoE):  # spread the router scores: no near tie for a rounding to flip
                torch.nn.init.normal_(module.router.weight, std=0.5)
        if nvfp4:
            quantize_experts(model)  # the grouped op
            quantize_linears(model, skip=("lm_head", "router"))
        with torch.no_grad():
            expected = {t: model(ids[:t], positions[:t], model.make_kv_cache()) for t in (7, 3)}
        sharded = tensor_parallel_glm_moe(model, capture_all_reduce=in_graph)
        assert "layers.0.gate_up" in sharded and "layers.1.mlp" in sharded and "layers.2.mlp" in sharded
        moe = model.layers[1].mlp
        assert moe.experts.down.shape[-1] == (8 if nvfp4 else 16)  # half of 32 intermediate columns (packed)
        assert moe.shared_down.in_features == 16 and moe.router.out_features == 8  # the router stays whole
        cache = model.make_kv_cache()
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
        with torch.no_grad():
            for tokens in (7, 3):
                cache.zero_()
                out = runner(ids[:tokens], positions[:tokens], cache)
                assert rel_error(out, expected[tokens]) <= 1e-5, (rank, tokens, rel_error(out, expected[tokens]))
        # attention cuts every layer; all-reduces between pieces cut twice per layer more (o_proj, and the dense
        # MLP's or the MoE block's), bf16 experts once more (the eager loop)
        cuts = 3 + (0 if in_graph else 6) + (0 if nvfp4 else 2)
        assert runner.stats["pieces"] == cuts + 1, runner.stats["pieces"]


@pytest.mark.parametrize("nvfp4,in_graph", [(False, False), (True, True)],
                         ids=["fp32", "nvfp4-grouped-all-reduce-in-pieces"])
def test_the_glm_moe_example_on_two_ranks_equals_the_whole_model(nvfp4, in_graph, ranks, request):
    """Routed and shared experts keep half their intermediate dimension, one all-reduce per MoE block."""
    expect_case(ranks, request)
