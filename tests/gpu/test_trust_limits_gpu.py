"""``tests/test_trust_limits.py`` with CUDA graphs replayed: a pipeline stage whose buffers take at most N rows
gets graphs up to the largest size that runs padded, its calls right at every count up to N; a layer deleted or a
module class's forward patched after the first call is refused before a replay runs the old code."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

import piecewise

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import test_trust_limits as cases  # noqa: E402

pytestmark = pytest.mark.gpu


def _stage(frontend: str, max_tokens: int):
    """The pipeline stage, its runner and its static buffers of ROWS rows."""
    torch.manual_seed(0)
    model = cases.Stage().eval().cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=max_tokens, frontend=frontend),
                               dynamic={"input_ids": 0, "positions": 0})
    return model, runner, torch.randn(cases.ROWS, 16, device="cuda"), torch.randn(cases.ROWS, 16, device="cuda")


@pytest.mark.parametrize("frontend", ["breakable", "auto"])
def test_a_stage_with_buffers_of_n_rows_replays_up_to_n(frontend):
    model, runner, hidden, residual = _stage(frontend, 64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tokens in [5, 3, cases.ROWS, 1, 7, 8]:
            new_hidden, new_residual = torch.randn_like(hidden), torch.randn_like(residual)
            hidden.copy_(new_hidden), residual.copy_(new_residual)
            ids = torch.randint(0, 64, (tokens,), device="cuda")
            positions = torch.arange(tokens, device="cuda")
            theirs = new_residual.clone()
            want = model(ids, positions, new_hidden.clone(), theirs)
            torch.testing.assert_close(runner(ids, positions, hidden, residual), want)
            torch.testing.assert_close(residual, theirs)
    assert runner.stats.cuda_graphs and max(runner.stats.capture_sizes) == 8
    assert runner.stats.padded_calls + runner.stats.full_calls >= 4


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_layer_deleted_after_the_first_call_is_refused_before_a_replay(frontend):
    model, runner, hidden, residual = _stage(frontend, 8)
    args = lambda n: (torch.randint(0, 64, (n,), device="cuda"), torch.arange(n, device="cuda"), hidden, residual)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner(*args(5))
        del model.linears[1]
        with pytest.raises(ValueError, match=r"`linears` had 2 layers at the first call and has 1 now"):
            runner(*args(3))


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_layers_reordered_in_place_after_the_first_call_are_refused_before_a_replay(frontend):
    """``_modules["0"], _modules["1"] = ...``: the same container, the same length and no registration hook, and
    every parameter at its address: a replay would run the old order."""
    model, runner, hidden, residual = _stage(frontend, 8)
    args = lambda n: (torch.randint(0, 64, (n,), device="cuda"), torch.arange(n, device="cuda"), hidden, residual)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner(*args(5))
        modules = model.linears._modules
        modules["0"], modules["1"] = modules["1"], modules["0"]
        with pytest.raises(ValueError, match=r"the layers of `linears` were replaced or reordered"):
            runner(*args(3))
