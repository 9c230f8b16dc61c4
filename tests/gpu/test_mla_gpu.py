"""MLA over the latent cache on CUDA graphs: three sequences through slots (prefill in one call, then decode steps
as full graphs with the Triton latent-attention kernel inside) equal transformers' forward in float32, for dense MLA
(DeepSeek-V3, GLM-4-MoE-Lite) and DeepSeek sparse attention (GLM-5, DeepSeek-V3.2), both front-ends; in bf16 the
graphs replay what the same runner computes without them."""

import os
import sys

import pytest
import torch

import piecewise

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import test_dsa  # noqa: E402
import test_mla  # noqa: E402

from piecewise.integrations.transformers import TokenModel, enable  # noqa: E402


def model_of(name: str):
    return test_dsa.build(name) if name in test_dsa.ARCHITECTURES else test_mla.build(name)


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("name", ["DeepseekV3", "Glm4MoeLite", "GlmMoeDsa", "DeepseekV32"])
def test_latent_attention_in_full_graphs_equals_transformers(name, frontend):
    model = model_of(name).cuda()
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 256, (11,), generator=generator).cuda() for _ in range(3)]
    with torch.no_grad():
        expected = [model(input_ids=s[None], use_cache=False).logits[0] for s in sequences]
    token_model = TokenModel(enable(model))
    cache = token_model.make_kv_cache(max_seq_len=32, sequences=3)
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend))
    with torch.no_grad():
        got = test_mla.run_steps(runner, sequences, cache, prompt=5)
    for logits, want in zip(got, expected):
        torch.testing.assert_close(logits, want, rtol=1e-3, atol=1e-3)
    assert runner.stats["replays"] > 0, dict(runner.stats)  # float32 experts are a splitting op: piecewise graphs


@pytest.mark.parametrize("name", ["DeepseekV3", "GlmMoeDsa"])
def test_bf16_graphs_replay_what_the_runner_computes_without_them(name):
    model = model_of(name).to("cuda", torch.bfloat16)
    token_model = TokenModel(enable(model))
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 256, (11,), generator=generator).cuda() for _ in range(3)]
    results = {}
    with torch.no_grad():
        for graphs in (False, True):
            cache = token_model.make_kv_cache(max_seq_len=32, sequences=3)
            runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16, cuda_graphs=graphs))
            results[graphs] = torch.cat(test_mla.run_steps(runner, sequences, cache, prompt=5))
        assert runner.stats["full_calls"] > 0, dict(runner.stats)  # bf16: grouped_mm experts, the latent op inside
    rel = float((results[True].float() - results[False].float()).norm() / results[False].float().norm())
    assert rel <= 1e-2, rel


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("name", ["DeepseekV3", "GlmMoeDsa"])
def test_an_fp8_latent_cache_in_full_graphs_equals_eager_over_one(name, frontend):
    """bf16 over FP8 rows (the Triton kernel reading the bytes): the runner, its decode steps in full graphs,
    equals the model run eagerly over an FP8 cache, and stays near transformers' forward (FP8's rounding)."""
    from piecewise.stored import values

    model = model_of(name).to("cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 256, (11,), generator=generator).cuda() for _ in range(3)]
    with torch.no_grad():
        expected = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in sequences]).float()
    token_model = TokenModel(enable(model))
    eager_cache = token_model.make_kv_cache(max_seq_len=32, sequences=3, dtype="fp8")
    cache = token_model.make_kv_cache(max_seq_len=32, sequences=3, dtype="fp8")
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend))
    with torch.no_grad():
        eager = torch.cat(test_mla.run_steps(token_model, sequences, eager_cache, prompt=5)).float()
        got = torch.cat(test_mla.run_steps(runner, sequences, cache, prompt=5)).float()
    assert runner.stats["full_calls"] > 0, dict(runner.stats)
    assert float((got - eager).norm() / eager.norm()) <= 1e-2
    assert float((values(cache) - values(eager_cache, cache)).float().norm() / values(eager_cache, cache).float().norm()) <= 2e-2
    assert float((got - expected).norm() / expected.norm()) <= 0.1  # FP8 and bf16 rounding, a pick flipped by them
