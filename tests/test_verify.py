"""``verify``: every size against eager with inputs other than the capture's; state restored; a mismatch says
where the forward parts from eager; ``CaptureConfig(verify=...)``; ``piecewise verify`` exit codes and JSON."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import piecewise
from piecewise.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
import break_models as bm  # noqa: E402
import doctor_targets  # noqa: E402

TARGETS = doctor_targets.__file__


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("attention", bm.ATTENTION)
def test_a_correct_model_passes_every_size_and_its_cache_is_put_back(frontend, attention):
    model = bm.make(None, attention)
    cache = model.make_cache()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad():
        runner(torch.randint(0, 64, (5,)), torch.arange(5), cache)
    before = cache.clone()
    report = runner.verify()
    assert report.ok, str(report)
    assert [r.size for r in report.results] == [1, 2, 4, 8]
    assert [r.tokens for r in report.results][-1] == [8, 7, 5]  # the size, one below, the smallest padded to it
    assert all(r.tolerance == 1e-4 for r in report.results)
    assert torch.equal(cache, before), "the cache verification wrote must be put back"
    assert "match" in str(report) and "MISMATCH" not in str(report)


def test_decode_at_the_end_of_a_full_cache_is_verified_with_positions_inside_it():
    """Every sequence at the cache's last position (a decode step over a full context): the inputs made for the
    other token counts stay inside the cache, and the stats say what the first call verified."""
    from piecewise.models.decode import DecodeLlama
    from piecewise.models.llama import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         intermediate_size=64, max_seq_len=16)
    model = DecodeLlama(config).eval()
    cache = model.make_kv_cache(8)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, verify="all"))
    with torch.no_grad():
        runner(torch.randint(0, 64, (5,)), torch.full((5,), config.max_seq_len - 1), cache)
    runner.stats.expect(verified_sizes=[1, 2, 4, 8])
    assert runner.stats["verify_seconds"] > 0


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_padding_rows_reaching_code_that_combines_tokens_is_a_mismatch_past_the_first_call_check(frontend):
    model, (x,) = doctor_targets.rolls_tokens()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad():
        runner(x)  # the first call's padding check (one pad row) cannot see it
    report = runner.verify()
    assert not report.ok
    bad = [r.size for r in report.results if not r.ok]
    assert bad == [8]
    failing = report.results[3]
    assert failing.max_error > failing.tolerance and "output 0" in failing.worst
    assert "no splitting call to bisect at" in failing.diverges
    assert "padding rows reaching code that combines tokens" in str(report)


def test_a_mismatch_names_the_stretch_between_splitting_calls_where_it_starts():
    class Late(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = bm.make(None, "no_cache")

        def forward(self, input_ids, positions, cache):
            logits = self.inner(input_ids, positions, cache)
            return logits + logits.roll(4, 0)  # after the last attention call

    model = Late()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="breakable"))
    report = runner.verify(torch.randint(0, 64, (1,)), torch.arange(1), model.inner.make_cache())
    failing = [r for r in report.results if not r.ok]
    assert failing and all("every splitting call gets eager's inputs" in r.diverges for r in failing)
    assert all("after `break_models::attend_local` at" in r.diverges and "break_models.py" in r.diverges
               for r in failing)


def test_make_inputs_overrides_the_example_and_sizes_picks_the_sizes():
    model = bm.make(None, "writes_cache")
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="breakable"))
    cache = model.make_cache()
    seen = []

    def make_inputs(tokens):
        seen.append(tokens)
        return (torch.randint(0, 64, (tokens,)), torch.arange(tokens) + 4, cache)

    report = runner.verify(torch.randint(0, 64, (3,)), torch.arange(3), cache, sizes=[4], make_inputs=make_inputs)
    assert report.ok and [r.size for r in report.results] == [4] and seen == [4, 3]
    with pytest.raises(ValueError, match=r"sizes \[5\] are not capture sizes.*\[1, 2, 4, 8\]"):
        runner.verify(sizes=[5])


def test_verify_at_the_first_call_raises_with_the_report_on_a_mismatch():
    model, (x,) = doctor_targets.rolls_tokens()
    good, (y,) = doctor_targets.clean_model()[0], doctor_targets.clean_model()[1]
    with torch.no_grad():
        runner = piecewise.compile(good, piecewise.CaptureConfig(max_tokens=8, verify="all"))
        torch.testing.assert_close(runner(y), good(y))
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, verify="first_last"))
        with pytest.raises(piecewise.VerificationError, match=r"(?s)differ from eager.*MISMATCH") as info:
            runner(x)
    assert [r.size for r in info.value.report.results] == [1, 8]
    with pytest.raises(ValueError, match=r"CaptureConfig.verify must be one of"):
        piecewise.CaptureConfig(verify="sometimes")


def test_cli_verify_exit_codes_and_json(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["verify", f"{TARGETS}:clean_model", "--max-tokens", "8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] is True and [s["size"] for s in data["sizes"]] == [1, 2, 4, 8]
    assert main(["verify", f"{TARGETS}:rolls_tokens", "--max-tokens", "8"]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    assert main(["verify", f"{TARGETS}:no_such_factory"]) == 2


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_the_models_own_buffers_are_compared_and_put_back_and_the_stats_stay_the_users(frontend):
    from fixtures import state_models

    model = state_models.TokensFirst(state_models.BatchFirstCache())
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad():
        runner(torch.randint(0, 100, (5,)), torch.arange(5))
    buffers = {name: value.clone() for name, value in model.named_buffers()}
    stats = dict(runner.stats)
    report = runner.verify()
    assert report.ok, str(report)
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name
    assert dict(runner.stats) == stats


def test_verify_compares_the_tensors_of_a_dataclass_output(monkeypatch):
    """Each field of a dataclass output is compared (torch's pytree takes the dataclass as one leaf): with every
    comparison made to fail, the report fails; a batch-first model's calls go through in its own layout."""
    from fixtures import state_models
    from piecewise.runtime import verify as verify_module

    for model, args in ((state_models.ReturnsADataclass().eval(), (torch.randn(3, 8),)),
                        (state_models.BatchFirstCache().eval(), (torch.randint(0, 100, (1, 6)), torch.arange(6)))):
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=None))
        with torch.no_grad():
            runner(*args)
            assert runner.verify().ok
            monkeypatch.setattr(verify_module, "rel_error", lambda ours, theirs: 1.0)
            report = runner.verify()
            monkeypatch.undo()
        assert not report.ok and report.results[0].worst.startswith("output 0")


class _AttributeCache(torch.nn.Module):
    """vLLM's layout of state: each layer's KV cache a plain module attribute (no buffer), or a list of caches
    handed in as an argument (vLLM's v0 ``kv_caches``)."""

    def __init__(self, in_argument: bool):
        super().__init__()
        self.in_argument = in_argument
        self.proj = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 8)
        self.kv_cache = torch.zeros(2, bm.MAX_SEQ, 8)

    def forward(self, x, positions, kv_caches=None):
        q, k, v = self.proj(x).split(8, dim=-1)
        cache = kv_caches[0] if self.in_argument else self.kv_cache
        return self.out(bm.attend_write(q, k, v, positions, cache))


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("in_argument", [False, True], ids=["module_attribute", "list_argument"])
def test_state_outside_buffers_and_arguments_is_compared_and_put_back(frontend, in_argument):
    """verify() writes the cache through both runs at made-up positions: a cache held as a plain module attribute or
    inside a list argument must be put back (it was left overwritten) and compared (a wrong write there shows)."""
    torch.manual_seed(0)
    model = _AttributeCache(in_argument).eval()
    caches = [torch.zeros(2, bm.MAX_SEQ, 8)] if in_argument else None
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    with torch.no_grad():
        runner(torch.randn(5, 8), torch.arange(5), caches)
    state = caches[0] if in_argument else model.kv_cache
    before = state.clone()
    report = runner.verify()
    assert report.ok, str(report)
    assert torch.equal(state, before), "verify() must put back the cache it wrote"
    name = "`kv_caches[0]`" if in_argument else "attribute `kv_cache`"
    assert any(name in what for what in _compared_names(runner)), _compared_names(runner)


def _compared_names(runner) -> list[str]:
    from piecewise.runtime.model_state import model_state

    return [name for name, _ in model_state(runner, runner.last_arguments or {})]


_METADATA: dict = {}


@piecewise.opaque_op("verify_tests::scaled_rows", split=True)
def _scaled_rows(x: torch.Tensor) -> torch.Tensor:
    """vLLM's attention shape of input: per-call metadata taken from a global forward context, not an argument."""
    return x * _METADATA["scale"][: x.shape[0], None]


class _ReadsMetadata(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(_scaled_rows(self.linear(x)))


def test_verify_on_a_model_whose_metadata_it_cannot_make_says_to_pass_make_inputs():
    torch.manual_seed(0)
    model = _ReadsMetadata()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=None))
    _METADATA["scale"] = torch.rand(5)
    with torch.no_grad():
        runner(torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"verify: the model fails on the inputs verify made for \d+ tokens .*"
                                         r"pass make_inputs=lambda num_tokens"):
        runner.verify()

    def make_inputs(tokens):
        _METADATA["scale"] = torch.rand(tokens)
        return (torch.randn(tokens, 4),)

    assert runner.verify(make_inputs=make_inputs).ok
