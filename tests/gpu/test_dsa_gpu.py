"""GLM-5 and DeepSeek-V3.2 (DeepSeek sparse attention) on CUDA graphs: bf16 and NVFP4, both front-ends, replay what
the same runner computes without graphs (routing and top-k are discontinuous: other roundings pick other keys)."""

import os
import sys

import pytest
import torch

import piecewise

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from test_dsa import ARCHITECTURES, build  # noqa: E402

from piecewise.integrations.transformers import TokenModel, enable, quantize  # noqa: E402


def steps(runner, token_model, ids):
    cache = token_model.make_kv_cache(max_seq_len=64)
    out = [runner(ids[:6], torch.arange(6, device="cuda"), cache)]
    out += [runner(ids[p : p + 1], torch.tensor([p], device="cuda"), cache) for p in range(6, 11)]
    return torch.cat(out)


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("nvfp4", [False, True], ids=["bf16", "nvfp4"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_dsa_on_cuda_graphs_replays_what_the_runner_computes_without_them(name, nvfp4, frontend):
    model = build(name).to("cuda", torch.bfloat16)
    token_model = TokenModel(enable(model))
    if nvfp4:
        quantize(model)
    ids = torch.randint(0, 256, (11,), device="cuda")
    results = {}
    with torch.no_grad():
        for graphs in (False, True):
            config = piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cuda_graphs=graphs)
            runner = piecewise.compile(token_model, config)
            results[graphs] = steps(runner, token_model, ids)
            assert runner.stats["cuda_graphs"] is graphs and (runner.stats["replays"] > 0) is graphs
    rel = float((results[True].float() - results[False].float()).norm() / results[False].float().norm())
    assert rel <= 1e-2, rel
