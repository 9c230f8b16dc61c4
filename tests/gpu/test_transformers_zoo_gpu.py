"""The architectures of tests/test_transformers_zoo.py on CUDA with CUDA graphs (float32): a prefill, then
decode steps replayed from the graphs, against transformers' forward over the whole sequence; and three
sequences decoding together through slots."""

import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

from test_transformers_zoo import ARCHITECTURES, decode_through_slots, prefill_then_decode  # noqa: E402


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_prefill_then_decode_on_cuda_graphs_equals_transformers(name):
    logits, expected, runner = prefill_then_decode(name, "cuda")
    torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-3)
    assert runner.stats["cuda_graphs"] and runner.stats["replays"] > 0


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_sequences_through_slots_on_cuda_graphs_equal_transformers(name):
    """The slot-attention kernel path: three sequences prefilled into their slots, then decoded together."""
    got, expected, runner = decode_through_slots(name, "cuda")
    for logits, reference in zip(got, expected):
        torch.testing.assert_close(logits, reference, rtol=1e-3, atol=1e-3)
    assert runner.stats["cuda_graphs"] and runner.stats["replays"] > 0
