"""``CaptureConfig(compiler="auto")``, the default: each candidate compiler's runner prepared and timed at the
first call, the fastest taken (Inductor only past the margin); equal to eager; the timing calls are rehearsals
(state kept across calls counts real calls only); the budget stops the search; the choice is recorded in the
persistent cache and taken without a search later; ``$PIECEWISE_COMPILER`` sets the default."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import piecewise
from piecewise.runtime import search

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
import break_models as bm  # noqa: E402
from fixtures import state_models  # noqa: E402


@pytest.fixture
def measured(monkeypatch):
    """The search on a CPU (no graphs there: the times only exercise the choice)."""
    monkeypatch.setattr(search, "MEASURE_WITHOUT_CUDA", True)


def run(model, config, tokens=3):
    runner = piecewise.compile(model, config)
    ours, theirs = model.make_cache(), model.make_cache()
    with torch.no_grad():
        for n, offset in ((tokens, 0), (1, tokens), (5, tokens + 1)):
            ids, positions = torch.arange(n) % 64, torch.arange(n) + offset
            torch.testing.assert_close(runner(ids, positions, ours), model(ids, positions, theirs), atol=1e-4,
                                       rtol=1e-4)
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    return runner


def test_without_cuda_graphs_auto_takes_eager_pieces_without_compiling_inductor():
    runner = run(bm.make(None), piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None))
    assert [c["compiler"] for c in runner.stats["candidates"]] == ["eager"]
    assert runner.config.compiler == "eager"
    assert "compiler 'eager' (no CUDA graphs: nothing to measure" in runner.stats["frontend_reason"]


def test_each_candidate_is_timed_and_the_fastest_taken(measured, monkeypatch):
    times = {"eager": 2.0, "inductor": 1.0}
    monkeypatch.setattr(search, "_timed", lambda trial, arguments, **_: {1: times[trial.config.compiler]})
    runner = run(bm.make(None), piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None))
    table = runner.stats["candidates"]
    assert [(c["compiler"], c["ms"]) for c in table] == [("eager", {1: 2.0}), ("inductor", {1: 1.0})]
    assert all(c["first_call_s"] > 0 for c in table)
    assert runner.config.compiler == "inductor" and runner.stats["frontend"] == "dynamo"
    assert "measured: eager 1: 2.000 ms; inductor 1: 1.000 ms -> inductor" in runner.stats["frontend_reason"]


def test_the_real_timing_calls_are_rehearsals_so_state_counts_real_calls_only(measured):
    model = state_models.CallCounter()
    counter = torch.zeros(())
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None),
                               dynamic={"x": 0})
    with torch.no_grad():
        for step in range(1, 4):
            runner(torch.randn(3, 8), counter)
            assert counter.item() == step
    assert {c["compiler"] for c in runner.stats["candidates"]} == {"eager", "inductor"}
    assert all(c["ms"] for c in runner.stats["candidates"])


def test_the_budget_stops_the_search_after_the_first_candidate(measured):
    runner = run(bm.make(None), piecewise.CaptureConfig(max_tokens=8, compiler="auto", compile_budget_s=1e-3,
                                                         cache_dir=None))
    assert [c["compiler"] for c in runner.stats["candidates"]] == ["eager"]
    assert "compile budget 0 s spent after eager" in runner.stats["frontend_reason"]


def test_the_choice_is_recorded_and_a_later_first_call_takes_it_without_a_search(measured, monkeypatch, tmp_path):
    times = {"eager": 1.0, "inductor": 2.0}
    monkeypatch.setattr(search, "_timed", lambda trial, arguments, **_: {1: times[trial.config.compiler]})
    config = piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=tmp_path)
    first = run(bm.make(None), config)
    assert [c["compiler"] for c in first.stats["candidates"]] == ["eager", "inductor"]
    later = run(bm.make(None), config)
    assert [c["compiler"] for c in later.stats["candidates"]] == ["eager"] and later.config.compiler == "eager"
    assert "compiler 'eager' (recorded in the cache by an earlier first call)" in later.stats["frontend_reason"]


def test_compile_budget_must_be_positive():
    with pytest.raises(ValueError, match=r"compile_budget_s must be a positive number of seconds, got 0"):
        piecewise.CaptureConfig(compile_budget_s=0)


def test_when_no_compiler_takes_the_model_the_first_refusal_is_raised(measured):
    from fixtures import state_models

    runner = piecewise.compile(state_models.TokenMixing("sum"),
                               piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None),
                               dynamic={"x": 0})
    with torch.no_grad(), pytest.raises(ValueError, match="mixes tokens|combines the token rows") as info:
        runner(torch.randn(3, 8))
    assert info.value.kind == "token_mixing"


def test_the_timing_calls_leave_no_trace_in_the_runner(measured):
    runner = run(bm.make(None), piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None))
    assert runner.stats["padded_calls"] == 3  # the three calls of run(), not the timing calls
    assert runner.last_arguments["input_ids"].shape[0] == 5  # the last call's, not a timing call's


def test_inductor_is_taken_only_when_faster_by_the_margin(measured, monkeypatch):
    """A later candidate must beat eager by more than ``search.MARGIN`` (5%): within it, eager pieces stay."""
    times = {"eager": 1.0, "inductor": 0.97}
    monkeypatch.setattr(search, "_timed", lambda trial, arguments, **_: {1: times[trial.config.compiler]})
    runner = run(bm.make(None), piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None))
    assert runner.config.compiler == "eager"
    assert "-> eager (Inductor is taken only when more than 5% faster)" in runner.stats["frontend_reason"]
    times["inductor"] = 0.9
    runner = run(bm.make(None), piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None))
    assert runner.config.compiler == "inductor"


def test_the_default_compiler_is_auto_and_the_environment_sets_another(monkeypatch):
    monkeypatch.delenv("PIECEWISE_COMPILER", raising=False)
    assert piecewise.CaptureConfig().compiler == "auto"
    monkeypatch.setenv("PIECEWISE_COMPILER", "eager")
    assert piecewise.CaptureConfig().compiler == "eager"
    assert piecewise.CaptureConfig(compiler="inductor").compiler == "inductor"  # an explicit setting wins
    monkeypatch.setenv("PIECEWISE_COMPILER", "fast")
    with pytest.raises(ValueError, match=r"compiler must be one of .* got 'fast' \(from \$PIECEWISE_COMPILER\)"):
        piecewise.CaptureConfig()


def decode_llama():
    """The bundled gpt-fast-style decode model (row b of a call is sequence b of the cache), small."""
    from piecewise.models.decode import DecodeLlama
    from piecewise.models.llama import LlamaConfig

    torch.manual_seed(0)
    return DecodeLlama(LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                   head_dim=8, intermediate_size=64, max_seq_len=16)).eval()


def test_the_timing_leaves_the_state_as_the_first_call_found_it_where_rows_are_sequences(measured, monkeypatch):
    """Timing a size above the first call's count repeats its rows; in a decode model whose row b is sequence b
    (gpt-fast's, the bundled DecodeLlama) those rows write other sequences' cache rows: put back after the search."""
    monkeypatch.setattr(search, "CANDIDATES", ("eager", "eager"))  # two candidates, both timed, nothing compiled
    model = decode_llama()
    ours = torch.randn(2, 2, 8, 2, 16, 8)
    theirs = ours.clone()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None))
    with torch.no_grad():
        for batch in (3, 8, 2):
            ids, positions = torch.randint(0, 64, (batch,)), torch.randint(0, 16, (batch,))
            torch.testing.assert_close(runner(ids, positions, ours), model(ids, positions, theirs))
            torch.testing.assert_close(ours, theirs, msg=lambda m: f"the cache after a call of {batch}: {m}")
    assert 8 in runner.stats["candidates"][0]["ms"]  # the size above the first call's count was timed


def test_counts_the_forward_refuses_are_not_timed_and_its_refusal_still_reaches_the_user(measured, monkeypatch):
    """A gpt-fast-style model whose cache holds fewer sequences (4) than the ladder's top (8): the search's call of
    8 rows raises in the model. The first call still succeeds, the search times what it can, and a user's call of
    too many rows gets the model's own error."""
    monkeypatch.setattr(search, "CANDIDATES", ("eager", "eager"))
    model = decode_llama()
    ours = torch.randn(2, 2, 4, 2, 16, 8)
    theirs = ours.clone()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None))
    with torch.no_grad():
        for batch in (3, 4, 1):
            ids, positions = torch.randint(0, 64, (batch,)), torch.randint(0, 16, (batch,))
            torch.testing.assert_close(runner(ids, positions, ours), model(ids, positions, theirs))
            torch.testing.assert_close(ours, theirs, msg=lambda m: f"the cache after a call of {batch}: {m}")
        with pytest.raises(ValueError, match="tokens but the KV cache holds 4 sequences"):
            runner(torch.randint(0, 64, (6,)), torch.randint(0, 16, (6,)), ours)
    assert [sorted(c["ms"]) for c in runner.stats["candidates"]] == [[1]] * 2  # 8 refused


def test_each_timed_size_counts_alike_so_a_prefill_does_not_drown_the_decode_steps(measured, monkeypatch):
    """Inductor 30% faster at one token and 4% slower at the top size: summed milliseconds would keep eager."""
    times = {"eager": {1: 1.0, 8: 10.0}, "inductor": {1: 0.7, 8: 10.4}}
    monkeypatch.setattr(search, "_timed", lambda trial, arguments, **_: times[trial.config.compiler])
    runner = run(bm.make(None), piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None))
    assert runner.config.compiler == "inductor"
    times["inductor"] = {1: 0.97, 8: 9.9}  # 2% faster at each: within the margin
    runner = run(bm.make(None), piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None))
    assert runner.config.compiler == "eager"


class ScaledOnFirstUse(torch.nn.Module):
    """A buffer the first forward fills, once (vLLM computes its KV-cache scales so): the search must not put the
    state back to before it."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.zeros(()))
        self.built = False

    def forward(self, x):
        if not self.built:
            self.scale.fill_(2.0)
            self.built = True
        return self.linear(x) * self.scale


def test_the_search_keeps_what_the_first_forward_builds(measured, monkeypatch):
    monkeypatch.setattr(search, "CANDIDATES", ("eager", "eager"))
    torch.manual_seed(0)
    model = ScaledOnFirstUse().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None))
    with torch.no_grad():
        for tokens in (3, 8, 1):
            x = torch.randn(tokens, 8)
            torch.testing.assert_close(runner(x), model(x))
    assert float(model.scale) == 2.0


def test_a_batch_first_model_is_searched_through_its_tokens_first_view(measured, monkeypatch):
    """The search's candidate runners take the runner's model as the runtime holds it (behind ``TokensFirst``) and
    the arguments tokens-first."""
    from piecewise.capture import compilers

    monkeypatch.setattr(compilers.InductorCompiler, "compile", lambda self, graph, example_inputs: graph.forward)
    torch.manual_seed(0)
    model = state_models.BatchFirstCache().eval()
    ids = torch.randint(0, 100, (1, 9))
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=None))
    reference = state_models.BatchFirstCache().eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        for start, stop in ((0, 6), (6, 7), (7, 9)):
            positions = torch.arange(start, stop)
            torch.testing.assert_close(runner(ids[:, start:stop], positions), reference(ids[:, start:stop], positions))
    assert {c["compiler"] for c in runner.stats["candidates"]} == {"eager", "inductor"}
    assert runner.token_arguments == {"idx": 1, "input_pos": 0}


class BroadcastWrite(torch.nn.Module):
    """``cache[positions] = k``: Dynamo's trace assumes more than one token (a broadcasting check), so it pads
    one-token calls to 2; the breakable front-end serves one token."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(32, 8))

    def forward(self, x, positions):
        k = self.lin(x)
        self.cache[positions] = k
        return k + self.cache[positions].sum(-1, keepdim=True)


def test_a_trace_that_pads_one_token_to_two_makes_inductor_on_breakable_a_candidate(measured, monkeypatch, tmp_path):
    """Timed at the same counts (one token as each serves it), Inductor on breakable wins here and is taken, then
    recorded with its front-end: a later process prepares it alone."""
    times = {("eager", "breakable"): 3.0, ("eager", "dynamo"): 3.0, ("inductor", "dynamo"): 2.0,
             ("inductor", "breakable"): 1.0}
    timed = []

    def fake(trial, arguments, **_):
        timed.append((trial.config.compiler, trial.stats.frontend))
        return {1: times[timed[-1]], 8: times[timed[-1]]}

    monkeypatch.setattr(search, "_timed", fake)
    config = piecewise.CaptureConfig(max_tokens=8, compiler="auto", cache_dir=tmp_path)
    for process in ("first", "later"):
        model = BroadcastWrite().eval()
        reference = BroadcastWrite().eval()
        reference.load_state_dict(model.state_dict())
        runner = piecewise.compile(model, config)
        with torch.no_grad():
            for n, offset in ((5, 0), (1, 5), (3, 6)):
                x, positions = torch.randn(n, 8), torch.arange(n) + offset
                torch.testing.assert_close(runner(x, positions), reference(x, positions))
                torch.testing.assert_close(model.cache, reference.cache)
        labels = [(c["compiler"], c.get("frontend")) for c in runner.stats["candidates"]]
        if process == "first":
            assert labels == [("eager", None), ("inductor", None), ("inductor", "breakable")]
            assert "-> inductor on breakable" in runner.stats["frontend_reason"]
        else:
            assert labels == [("inductor", "breakable")]
            assert "recorded in the cache by an earlier first call" in runner.stats["frontend_reason"]
        assert runner.config.compiler == "inductor" and runner.stats["frontend"] == "breakable"
