"""Exact full graphs: a forward whose writes into static tensors (a KV cache in buffers, gpt-fast's
``self.k[:, :, pos] = k``; ``cache.index_copy_``) are cut out of the pieces gets full graphs that hold those writes
and serve only calls of exactly their size: no pad row exists to write. Every other count runs piecewise, the
writes on the real rows. On a CPU the families run without graphs, through the same routing."""

from __future__ import annotations

import pytest
import torch

import piecewise
from fixtures.state_models import BatchFirstCache, CacheWriter

FRONTENDS = ("dynamo", "breakable")


def families(runner, call) -> str:
    before = dict(runner.stats)
    call()
    took = [name for name, key in (("full", "full_calls"), ("piecewise", "padded_calls"), ("direct", "fallback_calls"))
            if runner.stats[key] != before[key]]
    assert len(took) == 1, took
    return took[0]


def reset(model: BatchFirstCache) -> None:
    for layer in model.layers:
        layer.k.zero_()
        layer.v.zero_()


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_model_whose_only_cuts_are_cache_writes_takes_full_graphs_for_calls_of_exactly_a_size(frontend):
    """gpt-fast as it is called: the first call a prefill chunk, then chunks and decode steps of every kind of
    count. Counts on the ladder take the full graphs, the others run piecewise; outputs and caches equal eager."""
    torch.manual_seed(0)
    model = BatchFirstCache().eval()
    ids = torch.randint(0, 100, (1, 30))
    counts = (6, 1, 3, 4, 1, 2, 5, 8)  # padded: 3 → 4, 5 and 6 → 8

    def generate(call, route=None):
        reset(model)
        outputs, start = [], 0
        with torch.no_grad():
            for count in counts:
                def step(start=start, count=count):
                    outputs.append(call(ids[:, start:start + count], torch.arange(start, start + count)))
                route.append(families(call, step)) if route is not None else step()
                start += count
        return outputs, [t.clone() for layer in model.layers for t in (layer.k, layer.v)]

    expected, expected_cache = generate(model)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    route: list[str] = []
    got, cache = generate(runner, route)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    for a, b in zip(cache, expected_cache):
        torch.testing.assert_close(a, b)
    exact = {1, 2, 4, 8}
    assert route == ["piecewise" if i == 0 or c not in exact else "full" for i, c in enumerate(counts)], route
    runner.stats.expect(graph_mode="full_and_piecewise", full_sizes=[1, 2, 4, 8])
    assert "only calls of exactly its size" in runner.stats["graph_mode_reason"]


@piecewise.opaque_op("exact_full_tests::attend", split=True, capturable=True)
def attend(q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Each row attends over the whole cache: its pad rows reach no real row."""
    return (q @ cache[0].T).softmax(-1) @ cache[1]


class WriteThenAttend(torch.nn.Module):
    """The cache written in plain code (cut out of the pieces), attention in a capturable splitting op."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 24)

    def forward(self, x, positions, cache):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        cache[0].index_copy_(0, positions, k)
        cache[1].index_copy_(0, positions, v)
        return attend(q, cache)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_cache_writes_outside_a_capturable_op_make_the_full_graphs_exact_instead_of_turning_them_off(frontend):
    """Such writes used to turn full graphs off with a warning (a padded full graph would write its pad rows);
    the full graphs now serve the counts of their sizes, without a warning."""
    import warnings

    torch.manual_seed(0)
    model = WriteThenAttend().eval()
    cache, reference = torch.zeros(2, 32, 8), torch.zeros(2, 32, 8)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    start, route = 0, []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for count in (3, 4, 1, 5, 2, 8, 7):
            x, positions = torch.randn(count, 8), torch.arange(start, start + count)
            outputs = []
            route.append(families(runner, lambda: outputs.append(runner(x, positions, cache))))
            torch.testing.assert_close(outputs[0], model(x, positions, reference))
            torch.testing.assert_close(cache, reference)
            start += count
    assert route == ["piecewise", "full", "full", "piecewise", "full", "full", "piecewise"], route
    runner.stats.expect(graph_mode="full_and_piecewise")
    assert "every splitting op the model calls is capturable; writes into static tensors" in \
        runner.stats["graph_mode_reason"]


def test_a_model_without_splitting_op_or_cut_write_stays_piecewise():
    """Its one piece is the whole forward: a full graph would be the same graph captured twice."""
    runner = piecewise.compile(torch.nn.Linear(8, 8).eval(), piecewise.CaptureConfig(max_tokens=8, cache_dir=None))
    with torch.no_grad():
        runner(torch.randn(3, 8))
        assert families(runner, lambda: runner(torch.randn(4, 8))) == "piecewise"
    runner.stats.expect(graph_mode="piecewise", full_sizes=[])
    assert "no write cut out" in runner.stats["graph_mode_reason"]


class BreakThenWrite(CacheWriter):
    def forward(self, x, positions, cache):
        torch._dynamo.graph_break()
        return super().forward(x, positions, cache)


def test_dynamo_graph_breaks_keep_a_model_without_splitting_op_piecewise():
    """Between graphs Dynamo runs the forward's Python, which a full graph would skip."""
    model = BreakThenWrite().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo", cache_dir=None))
    cache, reference = torch.zeros(2, 32, 8), torch.zeros(2, 32, 8)
    with torch.no_grad():
        for count, start in ((3, 0), (4, 3), (2, 7)):
            x, positions = torch.randn(count, 8), torch.arange(start, start + count)
            torch.testing.assert_close(runner(x, positions, cache), model(x, positions, reference))
            torch.testing.assert_close(cache, reference)
    runner.stats.expect(graph_mode="piecewise", full_sizes=[], full_calls=0)
    assert "graph breaks" in runner.stats["graph_mode_reason"]


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_graph_mode_full_with_cut_writes_runs_other_counts_without_graphs_equal_to_eager(frontend):
    torch.manual_seed(0)
    model = CacheWriter().eval()
    cache, reference = torch.zeros(2, 32, 8), torch.zeros(2, 32, 8)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, graph_mode="full",
                                                              cache_dir=None))
    start = 0
    with torch.no_grad():
        for count, family in ((4, None), (3, "direct"), (2, "full"), (5, "direct"), (8, "full")):
            x, positions = torch.randn(count, 8), torch.arange(start, start + count)
            outputs = []
            taken = families(runner, lambda: outputs.append(runner(x, positions, cache)))
            assert family is None or taken == family, (count, taken)
            torch.testing.assert_close(outputs[0], model(x, positions, reference))
            torch.testing.assert_close(cache, reference)
            start += count
