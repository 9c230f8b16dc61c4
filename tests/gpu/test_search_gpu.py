"""The default ``compiler="auto"`` on CUDA: the first call prepares eager and Inductor pieces, times both and keeps
one, with full graphs for decode either way; outputs and the KV cache stay equal to eager; a later runner on the
same cache directory takes the recorded compiler without the search."""

import pytest
import torch

import piecewise
from piecewise.models.decode import DecodeLlama
from piecewise.models.llama import LlamaConfig

pytestmark = pytest.mark.gpu

CONFIG = LlamaConfig(vocab_size=256, hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64,
                     intermediate_size=512, max_seq_len=128)


def rel_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def test_the_default_measures_both_compilers_and_a_later_runner_takes_the_recorded_one(monkeypatch, tmp_path):
    monkeypatch.delenv("PIECEWISE_COMPILER", raising=False)  # the suite's eager pin off: the default as users get it
    torch.manual_seed(0)
    model = DecodeLlama(CONFIG).to("cuda", torch.bfloat16).eval()
    cache = torch.randn(CONFIG.num_layers, 2, 16, CONFIG.num_kv_heads, CONFIG.max_seq_len, CONFIG.head_dim,
                        device="cuda", dtype=torch.bfloat16)
    reference = cache.clone()
    runners = []
    for _ in range(2):
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, max_decode_batch=16,
                                                                  cache_dir=tmp_path))
        with torch.no_grad():
            for batch in (5, 1, 8, 16, 3):
                ids = torch.randint(0, 256, (batch,), device="cuda")
                positions = torch.randint(0, CONFIG.max_seq_len, (batch,), device="cuda")
                out = runner(ids, positions, cache)
                ref = model(ids, positions, reference)
                assert rel_error(out, ref) <= 2e-2 and rel_error(cache, reference) <= 2e-2, batch
        runners.append(runner)
    first, later = runners
    assert [c["compiler"] for c in first.stats["candidates"]] == ["eager", "inductor"]
    assert all(c["ms"] for c in first.stats["candidates"])
    chosen = first.config.compiler
    assert chosen in ("eager", "inductor") and f"-> {chosen}" in first.stats["frontend_reason"]
    first.stats.expect(graph_mode="full_and_piecewise", cuda_graphs=True)
    assert [c["compiler"] for c in later.stats["candidates"]] == [chosen] and later.config.compiler == chosen
    assert "recorded in the cache by an earlier first call" in later.stats["frontend_reason"]
    later.stats.expect(graph_mode="full_and_piecewise", cuda_graphs=True)
