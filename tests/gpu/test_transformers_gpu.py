"""transformers GLM-MoE models on CUDA under piecewise: captured pieces around the attention and expert ops.

Routing is discontinuous (near-tied expert scores swap under other roundings), so the comparisons with
transformers' own forward run in float32, and bf16 paths are compared with the same runner's padded calls
without graphs."""

import pytest
import torch

import piecewise

transformers = pytest.importorskip("transformers")
from piecewise.errors import CaptureFailed  # noqa: E402
from piecewise.integrations.transformers import TokenModel, enable  # noqa: E402

pytestmark = pytest.mark.gpu


def rel_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def glm_moe(dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.Glm4MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1, partial_rotary_factor=0.5,
        use_qk_norm=True, attention_bias=True)
    model = transformers.Glm4MoeForCausalLM(config).to(device="cuda", dtype=dtype).eval()
    model.config._experts_implementation = "eager"  # the reference loop (grouped_mm is bf16 only on CUDA)
    for module in model.modules():
        if type(module).__name__ == "Glm4MoeTopkRouter":
            torch.nn.init.normal_(module.weight, std=0.5)
        if hasattr(module, "gate_up_proj"):
            torch.nn.init.normal_(module.gate_up_proj, std=0.05)
            torch.nn.init.normal_(module.down_proj, std=0.05)
    return model


def test_glm_moe_captured_equals_transformers_eager():
    model = glm_moe()
    inputs = {t: torch.randint(0, 512, (t,), device="cuda") for t in (1, 7, 32)}
    with torch.no_grad():
        expected = {t: model(input_ids=ids[None], use_cache=False).logits[0] for t, ids in inputs.items()}
    runner = piecewise.compile(TokenModel(enable(model)), piecewise.CaptureConfig(max_tokens=32))
    with torch.no_grad():
        for tokens, ids in inputs.items():
            out = runner(ids, torch.arange(tokens, device="cuda"))
            assert rel_error(out, expected[tokens]) <= 1e-4, (tokens, rel_error(out, expected[tokens]))
    stats = runner.stats
    assert stats["cuda_graphs"] is True and stats["traces"] == 1 and stats["pieces"] == 6
    assert stats["graphs"] == 6 * len(stats["captured_sizes"])


def test_glm_moe_decode_steps_replay_graphs_and_match_the_whole_sequence():
    model = glm_moe()
    ids = torch.randint(0, 512, (12,), device="cuda")
    with torch.no_grad():
        expected = model(input_ids=ids[None], use_cache=False).logits[0]
    token_model = TokenModel(enable(model))
    cache = token_model.make_kv_cache(max_seq_len=64)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad():
        prompt = runner(ids[:8], torch.arange(8, device="cuda"), cache)
        assert rel_error(prompt, expected[:8]) <= 1e-4
        for position in range(8, 12):
            step = runner(ids[position : position + 1], torch.tensor([position], device="cuda"), cache)
            assert rel_error(step[0], expected[position]) <= 1e-4, position
    assert runner.stats["replays"] > 0


def test_sequences_decode_together_through_slots_with_captured_graphs():
    model = glm_moe()
    sequences = [torch.randint(0, 512, (length + 2,), device="cuda") for length in (6, 3, 9, 1)]
    with torch.no_grad():
        expected = [model(input_ids=ids[None], use_cache=False).logits[0] for ids in sequences]
    token_model = TokenModel(enable(model))
    cache = token_model.make_kv_cache(max_seq_len=32, sequences=4)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad():
        for slot, ids in enumerate(sequences):
            length = len(ids) - 2
            runner(ids[:length], torch.arange(length, device="cuda"), cache, torch.full((length,), slot, device="cuda"))
        for step in range(2):
            positions = torch.tensor([len(ids) - 2 + step for ids in sequences], device="cuda")
            tokens = torch.stack([ids[p] for ids, p in zip(sequences, positions)])
            out = runner(tokens, positions, cache, torch.arange(4, device="cuda"))
            for slot in range(4):
                assert rel_error(out[slot], expected[slot][positions[slot]]) <= 1e-4, (step, slot)
    assert runner.stats["replays"] > 0


@pytest.mark.parametrize("experts", ["grouped_mm-in-graphs", "nvfp4-grouped"])
def test_bf16_graphs_replay_what_the_padded_pieces_compute(experts):
    """bf16: transformers' grouped_mm experts inside the graphs, or NVFP4 grouped experts."""
    from piecewise.integrations.transformers import quantize

    model = glm_moe(torch.bfloat16)
    if experts == "grouped_mm-in-graphs":
        model.config._experts_implementation = "grouped_mm"
        enable(model, experts=False)
    else:
        quantize(enable(model), grouped_experts=True)
    ids = torch.randint(0, 512, (16,), device="cuda")
    results = []
    for cuda_graphs in (True, False):
        runner = piecewise.compile(TokenModel(model), piecewise.CaptureConfig(max_tokens=16, cuda_graphs=cuda_graphs))
        with torch.no_grad():
            results.append([runner(ids[:t], torch.arange(t, device="cuda")) for t in (16, 7, 1)])
        if cuda_graphs:
            assert runner.stats["pieces"] == 4 and runner.stats["replays"] > 0
    for captured, plain in zip(*results):
        assert rel_error(captured, plain) <= 1e-3


@pytest.mark.parametrize("name", ["mistral-window", "gemma2-window-softcap", "qwen2-moe-window", "phimoe-window"])
def test_sliding_windows_replayed_equal_transformers(name):
    """Windows passed to the attention (Mistral, Gemma 2) and one transformers applies only through its mask
    (Qwen2-MoE's sliding layers), float32, through the CUDA kernels: a prefill past the window, then decode steps
    replayed, against transformers' eager forward over the whole sequence. PhiMoE (its window in the config) is
    refused on CUDA for its rotary's copy from the host."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from test_transformers import windowed_models

    model = windowed_models()[name].cuda()
    ids = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        expected = model(input_ids=ids[None], position_ids=torch.arange(10, device="cuda")[None],
                         use_cache=False).logits[0]
    token_model = TokenModel(enable(model))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4, 8]))
    cache = token_model.make_kv_cache(max_seq_len=16)
    if name == "phimoe-window":  # its rotary copies inv_freq from the host at every call: refused, named
        with torch.no_grad(), pytest.warns(UserWarning), pytest.raises(CaptureFailed, match=r"modeling_phimoe.py"):
            runner(ids[:6], torch.arange(6, device="cuda"), cache)
        return
    with torch.no_grad():
        torch.testing.assert_close(runner(ids[:6], torch.arange(6, device="cuda"), cache), expected[:6],
                                   rtol=1e-4, atol=1e-4)
        for position in range(6, 10):
            step = runner(ids[position : position + 1], torch.tensor([position], device="cuda"), cache)
            torch.testing.assert_close(step[0], expected[position], rtol=1e-4, atol=1e-4)
    assert runner.stats["replays"] > 0
