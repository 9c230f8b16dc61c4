"""The architectures of tests/test_transformers_zoo.py on CUDA with CUDA graphs (float32): a prefill, then
decode steps replayed from the graphs, against transformers' forward over the whole sequence."""

import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

from test_transformers_zoo import ARCHITECTURES, prefill_then_decode  # noqa: E402


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_prefill_then_decode_on_cuda_graphs_equals_transformers(name):
    logits, expected, runner = prefill_then_decode(name, "cuda")
    torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-3)
    assert runner.stats["cuda_graphs"] and runner.stats["replays"] > 0
