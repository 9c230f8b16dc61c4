"""``tests/test_trust_accumulated.py`` with CUDA graphs replayed: counts that a custom op inside the graphs adds to
(vLLM's EPLB expert load) hold each call's real tokens once, never the padding's or the first call's rehearsals',
at every count, with piecewise and full graphs, each compiler and ``compiler="auto"``'s timing runs."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import piecewise
from piecewise.errors import ForwardRefused

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import test_trust_accumulated as cases  # noqa: E402

pytestmark = pytest.mark.gpu

COUNTS = [5, 3, 1, 8, 9, 2, 7, 8, 1]


@pytest.mark.parametrize("graph_mode", [None, "piecewise"])
@pytest.mark.parametrize("compiler", ["eager", "inductor", "auto"])
@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_count_added_to_inside_the_graphs_holds_each_call_once(frontend, compiler, graph_mode):
    model, twin = cases._twins()
    model, twin = model.cuda(), twin.cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=cases.MAX, frontend=frontend,
                                                              compiler=compiler, graph_mode=graph_mode))
    generator = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for calls, tokens in enumerate(COUNTS, 1):
            ids = torch.randint(0, 64, (tokens,), generator=generator, device="cuda")
            torch.testing.assert_close(runner(ids), twin(ids))
            assert torch.equal(model.load, twin.load), (tokens, model.load, twin.load)
            assert int(model.steps) == calls, (tokens, int(model.steps))
    assert runner.stats.cuda_graphs and runner.stats.eager_calls == 0
    assert runner.stats.padded_calls + runner.stats.full_calls > 0


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_static_histogram_a_splitting_op_adds_to_holds_each_call_once(frontend):
    torch.manual_seed(0)
    model = cases.Histogram().eval().cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=cases.MAX, frontend=frontend))
    histogram, want = torch.zeros(64, device="cuda"), torch.zeros(64, device="cuda")
    with torch.no_grad():
        for tokens in COUNTS:
            ids = torch.randint(0, 64, (tokens,), device="cuda")
            torch.testing.assert_close(runner(ids, histogram), model(ids, want.clone()))
            want.index_add_(0, ids, torch.ones(tokens, device="cuda"))
            assert torch.equal(histogram, want), tokens


@pytest.mark.parametrize("held", [False, True], ids=["argument", "attribute"])
@pytest.mark.parametrize("frontend", ["dynamo", "breakable", "auto"])
def test_a_cuda_generator_of_the_callers_is_refused_with_graphs_and_served_without(frontend, held):
    """Dynamo's replays drew other numbers than eager from it at every call (8 of 8 tokens, no warning); breakable's
    capture failed on it. Refused, naming it; without graphs the first call draws eager's numbers."""
    torch.manual_seed(0)
    model = cases.Sampler(held=False).eval().cuda()
    generator = torch.Generator(device="cuda").manual_seed(7)
    if held:
        model.generator = generator
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=cases.MAX, frontend=frontend))
    ids = torch.randint(0, 64, (cases.MAX,), device="cuda")
    named = "attribute `generator`" if held else "argument 'generator'"
    with torch.no_grad(), pytest.raises(ForwardRefused, match=f"of its own on CUDA \\({named}\\)"):
        runner(ids, None if held else generator)
    plain = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=cases.MAX, frontend=frontend,
                                                             cuda_graphs=False))
    with torch.no_grad(), pytest.warns(UserWarning, match="draws random numbers"):
        got = plain(ids, None if held else generator)
    generator.manual_seed(7)
    with torch.no_grad():
        torch.testing.assert_close(got, model(ids, None if held else generator))
