"""The breakable front-end and ``frontend="auto"`` on CPU: equal to eager (outputs and KV caches) for every place
a JIT-style call can sit × every kind of splitting op × sizes 1..max+1 × grad / no_grad / inference_mode."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import pytest
import torch

import piecewise

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
import break_models as bm  # noqa: E402
from fixtures import state_models  # noqa: E402

MAX_TOKENS = 8
GRAD_MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def run_sequence(model: torch.nn.Module, runner, mode: str, device: str = "cpu", offset: int = 0) -> None:
    """Prefills of 1..MAX_TOKENS+1 tokens (from position ``offset``), each followed by two decode steps, on fresh
    caches: the runner's outputs and cache equal the eager model's on its own cache at every step. With an
    offset the first positions stay empty: a write at a padding row's position 0 would show."""
    ours, theirs = model.make_cache(device), model.make_cache(device)
    with GRAD_MODES[mode]():
        for tokens in range(1, MAX_TOKENS + 2):
            ours.zero_(), theirs.zero_()
            steps = [torch.arange(tokens, device=device) + offset, torch.tensor([tokens + offset], device=device),
                     torch.tensor([tokens + offset + 1], device=device)]
            for positions in steps:
                ids = torch.randint(0, 64, positions.shape, device=device)
                got = runner(ids, positions, ours)
                with torch.no_grad():
                    expected = model(ids, positions, theirs)
                torch.testing.assert_close(got, expected, msg=lambda m: f"{tokens} tokens, positions {positions}: {m}")
                torch.testing.assert_close(ours, theirs, msg=lambda m: f"cache after {tokens} tokens: {m}")


@pytest.mark.parametrize("mode", list(GRAD_MODES))
@pytest.mark.parametrize("attention", bm.ATTENTION)
@pytest.mark.parametrize("jit_at", bm.PLACES)
def test_breakable_equals_eager_for_every_place_op_kind_size_and_grad_mode(jit_at, attention, mode):
    model = bm.make(jit_at, attention)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX_TOKENS, frontend="breakable"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the breakable front-end has nothing to warn about here
        run_sequence(model, runner, mode, offset=3)
    # Each prefill above max_tokens runs without padding; an in-place cache write in plain code (reads_cache) is
    # one more break, on the real rows.
    runner.stats.expect(frontend="breakable", traces=0, cuda_graphs=False, graph_breaks=0, fallback_calls=1)
    assert runner.stats["pieces"] >= model.num_layers + 1


@pytest.mark.parametrize("jit_at", bm.PLACES[1:])
def test_auto_takes_breakable_with_one_warning_naming_the_blocker_and_its_fix(jit_at):
    model = bm.make(jit_at, "writes_cache")
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX_TOKENS))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_sequence(model, runner, "no_grad", offset=3)  # the failed Dynamo trace must not write the cache
    ours = [str(w.message) for w in caught if "piecewise" in str(w.message)]
    assert len(ours) == 1, ours
    assert "runs with the breakable front-end" in ours[0] and "jit_subprocess" in ours[0]
    assert "break_models.py" in ours[0] and "wrap_opaque" in ours[0]  # where, and the fix that brings Dynamo back
    runner.stats.expect(frontend="breakable", traces=0)
    assert runner.stats["frontend_reason"].startswith("Dynamo blocked")


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_auto_leaves_a_trace_that_pads_one_token_calls_unless_it_compiles_the_pieces(compiler):
    """``cache[positions] = ...`` traces only for more than one token. With eager pieces Dynamo then gives the
    same graphs as breakable at fewer sizes: auto takes breakable, which serves one token too, with no warning;
    with inductor pieces it keeps Dynamo (and the fusion). Equal to eager at 1..max+1 either way."""
    model = state_models.SetItemWriter()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX_TOKENS, compiler=compiler))
    ours, theirs = torch.zeros(16, 8), torch.zeros(16, 8)
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("error", message="piecewise")  # a choice, not a failure
        for tokens in (3, *range(1, MAX_TOKENS + 2)):
            x = torch.randn(tokens, 8, generator=generator)
            positions = torch.randperm(16, generator=generator)[:tokens]
            torch.testing.assert_close(runner(x, positions, ours), model(x, positions, theirs), msg=str(tokens))
            torch.testing.assert_close(ours, theirs, msg=f"{tokens} tokens: the cache")
    if compiler == "eager":
        runner.stats.expect(frontend="breakable", traces=0, size_notes=[])
        assert runner.stats["capture_sizes"][0] == 1
        assert "serves every size" in runner.stats["frontend_reason"]
        assert "calls of 1 token are padded to 2" in runner.stats["frontend_reason"]
    else:
        runner.stats.expect(frontend="dynamo", traces=1)
        assert runner.stats["capture_sizes"][0] == 2


@pytest.mark.parametrize("attention", bm.ATTENTION)
def test_auto_takes_dynamo_when_it_traces_the_forward_whole(attention):
    model = bm.make(None, attention)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX_TOKENS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_sequence(model, runner, "no_grad")
    runner.stats.expect(frontend="dynamo", traces=1, graph_breaks=0)


def test_breakable_refuses_a_state_update_from_its_own_value_with_the_line():
    runner = piecewise.compile(state_models.StepCounter(), piecewise.CaptureConfig(max_tokens=4, frontend="breakable"))
    with torch.no_grad(), pytest.raises(ValueError, match=r"(?s)`add_` at .*state_models.py:\d+.*self.steps \+= 1.*"
                                                         r"applied more than once") as info:
        runner(torch.randn(3, 8))
    assert info.value.kind == "state_update"


def test_breakable_splitting_op_skips_rehearsals_and_counts_each_call_once():
    model = state_models.CallCounter()
    counter = torch.zeros(())
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=4, frontend="breakable"), dynamic={"x": 0})
    with torch.no_grad():
        for step in range(1, 4):
            runner(torch.randn(3, 8), counter)
            assert counter.item() == step


def test_max_padding_factor_runs_wasteful_calls_without_padding():
    model = bm.make(None, "writes_cache")
    config = piecewise.CaptureConfig(capture_sizes=[1, 8], frontend="breakable", max_padding_factor=2)
    runner = piecewise.compile(model, config)
    cache, expected_cache = model.make_cache(), model.make_cache()
    with torch.no_grad():
        for tokens, padded in ((3, False), (4, True), (1, True)):  # 3 → 8 is 2.7x: direct; 4 → 8 is 2x: padded
            before = dict(runner.stats)
            positions = torch.arange(tokens)
            ids = torch.randint(0, 64, (tokens,))
            torch.testing.assert_close(runner(ids, positions, cache), model(ids, positions, expected_cache))
            assert runner.stats["padded_calls"] - before["padded_calls"] == int(padded)
            assert runner.stats["fallback_calls"] - before["fallback_calls"] == int(not padded)
    torch.testing.assert_close(cache, expected_cache)


def test_stats_is_typed_and_reads_like_a_dict():
    runner = piecewise.compile(bm.make(), piecewise.CaptureConfig(max_tokens=4, frontend="breakable"))
    model = runner.model
    with torch.no_grad():
        runner(torch.randint(0, 64, (3,)), torch.arange(3), model.make_cache())
    assert dict(runner.stats)["frontend"] == runner.stats.frontend == "breakable"
    with pytest.raises(AssertionError, match=r"traces: 0 != expected 5"):
        runner.stats.expect(traces=5)
    with pytest.raises(KeyError, match="no field"):
        runner.stats.expect(nosuch=1)


def test_doctor_reports_each_front_end_and_recommends_one():
    blocked = piecewise.doctor(bm.make("mlp", "writes_cache"), torch.randint(0, 64, (5,)), torch.arange(5),
                               bm.make().make_cache())
    assert blocked.frontends == {"dynamo": False, "breakable": True}
    assert blocked.recommended[0] == "breakable" and "frontend='auto' takes it" in blocked.recommended[1]
    assert "use breakable" in str(blocked) and blocked.to_dict()["recommended"] == "breakable"
    clean = piecewise.doctor(bm.make(None, "writes_cache"), torch.randint(0, 64, (5,)), torch.arange(5),
                             bm.make().make_cache())
    assert clean.ok and clean.recommended[0] == "dynamo"
    neither = piecewise.doctor(state_models.StepCounter(), torch.randn(3, 8))
    assert neither.frontends == {"dynamo": False, "breakable": False} and neither.recommended[0] is None
    assert [b.kind for b in neither.breakable_blockers] == ["state_update"]


def test_doctor_recommends_breakable_when_dynamos_trace_pads_one_token_calls_as_auto_does():
    report = piecewise.doctor(state_models.SetItemWriter(), torch.randn(3, 8), torch.arange(3), torch.zeros(16, 8))
    assert report.ok and report.size_notes[0].startswith("calls of 1 token are padded to 2")
    choice, reason = report.recommended
    assert choice == "breakable" and "frontend='auto' takes it" in reason and "compiler='inductor'" in reason
    assert "use breakable" in str(report) and "cache[positions] = self.proj(x)" in str(report)
    assert report.to_dict()["recommended"] == "breakable" and report.to_dict()["size_notes"] == report.size_notes


@piecewise.opaque_op("test_breakable::offset_rows")
def offset_rows(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return x + positions[:, None].to(x.dtype)


class MetadataOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, positions):
        return offset_rows(self.linear(x), positions)


def test_doctor_warns_about_an_opaque_op_that_takes_per_call_metadata_and_is_not_a_splitting_op():
    report = piecewise.doctor(MetadataOp(), torch.randn(5, 8), torch.arange(5))
    assert report.ok and len(report.warnings) == 1
    assert "`test_breakable::offset_rows`" in report.warnings[0] and "positions" in report.warnings[0]
    assert "test_breakable.py:" in report.warnings[0] and "split=True" in report.warnings[0]
    assert "warning:" in str(report)
    assert not piecewise.doctor(bm.make(None, "writes_cache"), torch.randint(0, 64, (5,)), torch.arange(5),
                                bm.make().make_cache()).warnings  # its attention ops are splitting ops


def test_a_gpt_fast_cache_write_with_tokens_in_dimension_2_runs_on_the_real_rows():
    model = state_models.TokensFirst(state_models.BatchFirstCache())
    reference = state_models.TokensFirst(state_models.BatchFirstCache())
    reference.load_state_dict(model.state_dict())
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="breakable"))
    with torch.no_grad():
        for start, tokens in ((0, 5), (5, 1), (6, 3)):
            idx, pos = torch.randint(0, 100, (tokens,)), torch.arange(start, start + tokens)
            torch.testing.assert_close(runner(idx, pos), reference(idx, pos))
    for ours, theirs in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(ours, theirs)  # the pad rows never wrote position 0


@piecewise.opaque_op("test_breakable::quantize", split=True, fake=lambda x: (torch.empty_like(x), x.new_empty(1)))
def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax().reshape(1) + 1  # one scale for the call: no token rows, though [1] at one token
    return x / scale, scale


class Quantized(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        q, scale = quantize(self.linear(x))
        return q * scale * 2


@pytest.mark.parametrize("first", [1, 5])
def test_a_splitting_op_output_without_token_rows_is_not_padded_even_at_one_token(first):
    model = Quantized()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend="breakable"))
    with torch.no_grad():
        for tokens in (first, 1, 3, 8, 16):
            x = torch.randn(tokens, 8)
            torch.testing.assert_close(runner(x), model(x))


@piecewise.opaque_op("test_breakable::scores", split=True, fake=lambda q: q.new_empty(q.shape[1], q.shape[0]))
def scores(q: torch.Tensor) -> torch.Tensor:
    return q.T.contiguous()  # [heads, tokens]: tokens in dimension 1


def test_a_splitting_op_output_with_tokens_in_another_dimension_is_a_clear_error():
    class Transposed(torch.nn.Module):
        def forward(self, x):
            return scores(x * 2).T

    runner = piecewise.compile(Transposed(), piecewise.CaptureConfig(max_tokens=8, frontend="breakable"))
    with torch.no_grad(), pytest.raises(ValueError, match=r"splitting op `test_breakable::scores` at .*test_breakable"
                                                          r"\.py:\d+ .* returns output 0 of shape \(4, 3\) for 3 "
                                                          r"tokens, with the tokens in dimension 1, not 0"):
        runner(torch.randn(3, 4))


@piecewise.opaque_op("test_breakable::token_pairs", split=True, fake=lambda q: q.new_empty(q.shape[0], q.shape[0]))
def token_pairs(q: torch.Tensor) -> torch.Tensor:
    return q @ q.T  # [tokens, tokens]


def test_a_splitting_op_output_with_the_token_count_in_two_dimensions_names_both():
    class Pairs(torch.nn.Module):
        def forward(self, x):
            return token_pairs(x * 2) + 1

    runner = piecewise.compile(Pairs(), piecewise.CaptureConfig(max_tokens=8, frontend="breakable"))
    with torch.no_grad(), pytest.raises(ValueError, match=r"returns output 0 of shape \(3, 3\) for 3 tokens, with "
                                                          r"the token count in dimensions 0, 1; piecewise pads and "
                                                          r"cuts dimension 0 only") as refused:
        runner(torch.randn(3, 4))
    assert "transpose" not in str(refused.value)


@piecewise.opaque_op("test_breakable::pairs", split=True, fake=lambda q: q.new_empty(2 * q.shape[0], q.shape[1]))
def pairs(q: torch.Tensor) -> torch.Tensor:
    return torch.cat([q, -q])  # [2 * tokens, dim]: dimension 0 grows with the tokens, but twice as fast


def test_a_splitting_op_output_whose_dimension_0_is_not_the_token_count_is_a_clear_error():
    class Doubled(torch.nn.Module):
        def forward(self, x):
            return pairs(x * 2)[: x.shape[0]]

    runner = piecewise.compile(Doubled(), piecewise.CaptureConfig(max_tokens=8, frontend="breakable"))
    with torch.no_grad(), pytest.raises(ValueError, match=r"output 0 of `test_breakable::pairs` at .* has dimension 0 "
                                                          r"of 6 at 3 tokens and 4 at 2: it grows with the token count "
                                                          r"without being it"):
        runner(torch.randn(3, 4))


def test_op_leaves_is_tree_leaves():
    """The interceptor's per-op flattening gives pytree's leaves, in pytree's order, for any nesting of what ops take
    and return (and of containers pytree knows and it does not special-case)."""
    import collections

    from hypothesis import given, settings
    from hypothesis import strategies as st
    from torch.utils._pytree import tree_leaves

    from piecewise.frontends.breakable_outside import op_leaves

    pair = collections.namedtuple("pair", "first second")
    tensors = [torch.zeros(1), torch.nn.Parameter(torch.ones(2)), torch.empty(0, device="meta")]
    leaf = st.one_of(st.sampled_from(tensors), st.integers(), st.floats(allow_nan=False), st.none(), st.text(max_size=2),
                     st.sampled_from([torch.float16, torch.device("cpu")]))
    tree = st.recursive(leaf, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), inner, max_size=3),
        st.dictionaries(st.text(max_size=2), inner, max_size=2).map(collections.OrderedDict),
        st.tuples(inner, inner).map(lambda t: pair(*t))), max_leaves=12)

    @settings(max_examples=300, deadline=None)
    @given(tree)
    def check(value):
        ours, theirs = op_leaves(value), tree_leaves(value)
        assert len(ours) == len(theirs) and all(a is b for a, b in zip(ours, theirs))

    check()
