"""Outputs in the shapes ports return them, with graphs replayed: a dataclass (SGLang's LogitsProcessorOutput) is
cut to the call's tokens and copied out of graph memory, every call its own."""

import pytest
import torch

import piecewise
from fixtures.state_models import Logits, ReturnsADataclass

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_dataclass_output_is_cut_and_copied_with_graphs(frontend):
    torch.manual_seed(0)
    model = ReturnsADataclass(width=64, vocab=128).cuda().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cache_dir=None))
    kept = []
    with torch.no_grad():
        for tokens in (3, 5, 1, 16, 7, 3):
            x = torch.randn(tokens, 64, device="cuda")
            got, want = runner(x), model(x)
            assert isinstance(got, Logits) and got.next_token_logits.shape == (tokens, 128)
            torch.testing.assert_close(got.next_token_logits, want.next_token_logits)
            torch.testing.assert_close(got.hidden_states, want.hidden_states)
            kept.append((got, want))
    for got, want in kept:
        torch.testing.assert_close(got.next_token_logits, want.next_token_logits)
    assert runner.stats.replays + runner.stats.full_replays > 0
