"""The architectures of tests/test_transformers_zoo.py on CUDA with CUDA graphs (float32): a prefill, then
decode steps replayed from the graphs, against transformers' forward over the whole sequence."""

import pytest
import torch

import piecewise

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

from piecewise.integrations.transformers import TokenModel, enable  # noqa: E402
from test_transformers_zoo import ARCHITECTURES, build  # noqa: E402


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_prefill_then_decode_on_cuda_graphs_equals_transformers(name):
    model = build(name).cuda()
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        expected = model(input_ids=ids[None], use_cache=False).logits[0]
    token_model = TokenModel(enable(model))
    runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=16))
    cache = token_model.make_kv_cache(max_seq_len=32)
    with torch.no_grad():
        logits = [runner(ids[:6], torch.arange(6, device="cuda"), cache)]
        for position in range(6, 11):
            logits.append(runner(ids[position : position + 1], torch.tensor([position], device="cuda"), cache))
    torch.testing.assert_close(torch.cat(logits), expected, rtol=1e-3, atol=1e-3)
    assert runner.stats["cuda_graphs"] and runner.stats["replays"] > 0
