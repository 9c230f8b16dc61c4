"""The CUDA path: graphs really captured and replayed, bf16 parity with eager, one shared pool."""

import warnings

import pytest
import torch

import piecewise
from piecewise.models import example

pytestmark = pytest.mark.gpu


def rel_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def make(tokens=5, **config):
    model, (ids, positions, cache) = example(tokens=tokens, device="cuda", dtype=torch.bfloat16, **config)
    return model, ids, positions, cache


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_bf16_matches_eager_for_every_token_count(compiler):
    model, ids, positions, cache = make(num_layers=3)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=32, compiler=compiler, graph_mode="piecewise"))
    runner(ids, positions, cache)
    stats = runner.stats
    assert stats["cuda_graphs"] is True
    assert stats["captured_sizes"] == piecewise.CaptureConfig(max_tokens=32).sizes
    assert stats["pieces"] == 4
    assert stats["graphs"] == 4 * len(stats["captured_sizes"])
    direct = stats["direct_calls"]
    for _ in range(2):  # the second pass replays with the row views the first one made
        for tokens in range(1, 36):
            ids = torch.randint(0, model.config.vocab_size, (tokens,), device="cuda")
            positions = torch.arange(tokens, device="cuda") + 11
            reference_cache = cache.clone()
            ref = model(ids, positions, reference_cache)
            replays = runner.stats["replays"]
            out = runner(ids, positions, cache)
            assert rel_error(out, ref) <= 1e-2, tokens
            assert rel_error(cache, reference_cache) <= 1e-2
            if tokens <= 32:
                assert runner.stats["replays"] - replays == 4, "every piece must replay its graph"
    assert runner.stats["traces"] == 1
    assert runner.stats["fallback_calls"] == 6
    assert runner.stats["direct_calls"] - direct == 70, "calls after capture skip Dynamo's frame hook"


def test_pool_is_shared_across_sizes():
    model, ids, positions, cache = make(num_layers=2, hidden_size=512, intermediate_size=1024)
    one = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=512, capture_sizes=[512]))
    one(ids, positions, cache)
    many = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=512))
    many(ids, positions, cache)
    assert len(many.stats["captured_sizes"]) + len(many.stats["full_only_sizes"]) == 51
    assert many.stats["full_only_sizes"] == [size for size in many.config.sizes if size <= 256]
    print("pool bytes: one size", one.stats["pool_bytes"], "51 sizes", many.stats["pool_bytes"])
    assert 0 < many.stats["pool_bytes"] < 51 * one.stats["pool_bytes"] / 4


def test_moved_static_buffer_is_an_error_on_cuda():
    model, ids, positions, cache = make()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16))
    runner(ids, positions, cache)
    with pytest.raises(ValueError, match="kv_cache"):
        runner(ids, positions, cache.clone())


def test_retrace_after_capture_runs_without_graphs_and_warns():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)

        def forward(self, x, scale: float):
            return self.linear(x) * scale

    model = Scaled().cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16))
    x = torch.randn(5, 64, device="cuda")
    runner(x, 2.0)
    with pytest.warns(UserWarning, match="scale"):
        out = runner(x, 3.0)
    torch.testing.assert_close(out, model(x, 3.0))
    torch.testing.assert_close(runner(x, 2.0), model(x, 2.0))


def test_capture_illegal_op_names_the_line():
    class Syncs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x):
            y = self.linear(x)
            return y.cpu().cuda() + 1  # capture-illegal: blocking copy

    runner = piecewise.compile(Syncs().cuda(), piecewise.CaptureConfig(max_tokens=8))
    with pytest.raises(RuntimeError) as info, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner(torch.randn(3, 16, device="cuda"))
    message = str(info.value)
    assert "test_runtime_gpu.py" in message and "capture_illegal" in message and "cpu" in message
    assert not [w for w in caught if "CUDA Graph is empty" in str(w.message)]  # our message only


def test_doctor_trial_capture_finds_capture_illegal_ops():
    """A blocking copy the trace's scan does not know (`.to("cpu")`; `.cpu()` it reports as host_sync at the
    same line, which then is the one report of that line) fails the trial capture."""

    class Syncs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.linear(x).to("cpu").to(x.device) + 1  # capture-illegal line

    report = piecewise.doctor(Syncs().cuda(), torch.randn(4, 16, device="cuda"))
    kinds = [b.kind for b in report.blockers]
    assert "capture_illegal" in kinds, str(report)
    blocker = report.blockers[kinds.index("capture_illegal")]
    assert blocker.chain and blocker.chain[-1].file.endswith("test_runtime_gpu.py")
    assert blocker.chain[-1].function == "forward"
    clean = torch.nn.Linear(16, 16).cuda()
    assert piecewise.doctor(clean, torch.randn(4, 16, device="cuda")).ok


def test_released_graphs_free_the_pool_and_calls_stay_correct():
    model, ids, positions, cache = make(num_layers=2)
    with piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16)) as runner:
        runner(ids, positions, cache)
        assert runner.stats["full_graphs"] == len(runner.stats["full_only_sizes"]) == 5  # every size whole
        pieces = [piece for graph_runner in runner.frontend.graph_runners for piece in graph_runner.pieces]
    assert all(not piece.segments and not piece.outputs for piece in pieces) and runner.state.pool is None
    stats = runner.stats
    assert stats["cuda_graphs"] is False and stats["graphs"] == 0 and stats["captured_sizes"] == []
    assert stats["full_graphs"] == 0 and stats["full_only_sizes"] == []
    replays = stats["replays"]
    for tokens in (1, 7, 16):
        step_ids, step_positions = ids[:1].repeat(tokens), torch.arange(tokens, device="cuda")
        reference_cache = cache.clone()
        ref = model(step_ids, step_positions, reference_cache)
        out = runner(step_ids, step_positions, cache)
        assert rel_error(out, ref) <= 1e-2, tokens
    assert runner.stats["replays"] == replays


def test_cache_writes_in_traced_code_replay_on_the_real_rows():
    """Writes into a static cache in plain traced code run eagerly between the captured pieces, on the real
    rows: the padding rows of a replayed size never reach the cache."""
    from fixtures.state_models import CacheWriter

    torch.manual_seed(0)
    model = CacheWriter().cuda()
    cache, expected = torch.zeros(2, 64, 8, device="cuda"), torch.zeros(2, 64, 8, device="cuda")
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16))
    start = 0
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens in (3, 1, 5, 2, 7, 13, 20):  # padded to 4, 1, 8, 2, 8, 16; 20 runs unpadded
            x, positions = torch.randn(tokens, 8, device="cuda"), torch.arange(start, start + tokens, device="cuda")
            torch.testing.assert_close(runner(x, positions, cache), model(x, positions, expected))
            torch.testing.assert_close(cache, expected)
            start += tokens
    assert runner.stats["cuda_graphs"] and runner.stats["replays"] > 0 and runner.stats["eager_writes"] == 2
    # The piece between the two cache writes is views only: it runs eagerly, without torch's empty-graph warning.
    assert not [w for w in caught if "CUDA Graph is empty" in str(w.message)]
    sizes = len(runner.stats["captured_sizes"])
    assert 0 < runner.stats["graphs"] < runner.stats["pieces"] * sizes


def test_a_splitting_op_counts_each_call_once_through_capture():
    """The first call warms up, then runs and captures every size (1 + 2·sizes rehearsals); a splitting op
    that skips context().rehearsal counts it once."""
    from fixtures.state_models import CallCounter

    model = CallCounter().cuda()
    counter, expected = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad():
        for calls, tokens in enumerate((3, 5, 1, 16, 40), start=1):
            x = torch.randn(tokens, 8, device="cuda")
            torch.testing.assert_close(runner(x, counter), model(x, expected))
            assert float(counter) == float(expected) == calls
    assert runner.stats["cuda_graphs"] and len(runner.stats["captured_sizes"]) > 1


def test_a_forward_that_mixes_token_rows_is_refused_on_cuda_before_capture():
    from fixtures.state_models import TokenMixing

    runner = piecewise.compile(TokenMixing("sum").cuda(), piecewise.CaptureConfig(max_tokens=16))
    with torch.no_grad(), pytest.raises(ValueError, match=r"the forward mixes tokens.*return h \+ h.sum\(0\)"):
        runner(torch.randn(5, 8, device="cuda"))
    assert runner.stats["graphs"] == 0
