"""``frontend="breakable", compiler="inductor"`` on CUDA graphs: the compiled regions' kernels recorded into the
segments, replayed, equal to eager (outputs and KV caches, Inductor's float32 tolerance) for each place a JIT-style
call sits and each kind of splitting op; a transformers Llama through TokenModel with full graphs for decode
(``test_full_graphs_gpu.py`` runs the decode model's full graphs with it too)."""

import os
import sys

import pytest
import torch

import piecewise

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures"))
import break_models as bm  # noqa: E402

pytestmark = pytest.mark.gpu

MAX_TOKENS = 8


def rel_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("attention", bm.ATTENTION)
@pytest.mark.parametrize("jit_at", bm.PLACES)
def test_compiled_regions_replay_equal_to_eager(jit_at, attention):
    model = bm.make(jit_at, attention, device="cuda")
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX_TOKENS, frontend="breakable",
                                                              compiler="inductor"))
    ours, theirs = model.make_cache(), model.make_cache()
    with torch.inference_mode():
        for tokens in range(1, MAX_TOKENS + 2):
            ours.zero_(), theirs.zero_()
            for positions in (torch.arange(tokens) + 3, torch.tensor([tokens + 3]), torch.tensor([tokens + 4])):
                positions = positions.cuda()
                ids = torch.randint(0, 64, positions.shape, device="cuda")
                replays = runner.stats["replays"] + runner.stats["full_replays"]
                out = runner(ids, positions, ours)
                ref = model(ids, positions, theirs)
                assert rel_error(out, ref) <= 1e-4, (tokens, positions)
                assert rel_error(ours, theirs) <= 1e-4, (tokens, positions)
                if positions.numel() <= MAX_TOKENS:
                    assert runner.stats["replays"] + runner.stats["full_replays"] > replays, "no graph replayed"
    stats = runner.stats
    stats.expect(frontend="breakable", cuda_graphs=True, captured_sizes=runner.stats["capture_sizes"])
    # the regions' kernels first run before the capture: a size runs padded first only where its capture failed
    # (the largest always does: the first capture of a process)
    assert stats["compiled_regions"] >= 1 and max(stats["capture_sizes"]) in stats["warmed_sizes"]
    assert set(stats["warmed_sizes"]) <= set(stats["capture_sizes"])


def test_transformers_llama_decode_and_prefill_with_compiled_regions_and_full_graphs():
    transformers = pytest.importorskip("transformers")
    from piecewise.integrations.transformers import TokenModel, enable

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda").eval()
    prompt = torch.randint(0, 256, (4, 12), device="cuda")
    with torch.inference_mode():
        reference = model(prompt).logits[:, -1]  # transformers' own attention, before enable() replaces it
    token_model = TokenModel(enable(model))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16, frontend="breakable",
                                                                    compiler="inductor"))
    cache = token_model.make_kv_cache(max_seq_len=64, sequences=4, device="cuda")
    with torch.inference_mode():
        for s in range(4):  # prefill each sequence in its slot
            runner(prompt[s], torch.arange(12, device="cuda"), cache, torch.full((12,), s, device="cuda"))
        step = runner(prompt[:, -1], torch.full((4,), 11, device="cuda"), cache, torch.arange(4, device="cuda"))
    # the decode step re-writes position 11 of each slot: its logits are the prompt's last logits
    assert rel_error(step, reference) <= 1e-4
    assert runner.stats["full_replays"] >= 1 and runner.stats["compiled_regions"] >= 1
