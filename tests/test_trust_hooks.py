"""Never silently wrong, with hooks and fallbacks: Python forward hooks added or removed after the first call (on a
submodule, on the model, global ones) send calls to the model's own forward with one warning; hooks on the compiled
module itself are refused by the Dynamo front-end (``auto`` takes breakable, which runs them); a call that falls
back returns ordinary tensors; outputs whose token dimension is not the first keep full graphs."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.modules.module import register_module_forward_hook

import piecewise
from piecewise.errors import ForwardRefused
from piecewise.models.llama import LlamaConfig, TinyLlama

FRONTENDS = ["dynamo", "breakable"]
CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, max_seq_len=64)


def build(frontend: str):
    torch.manual_seed(0)
    model = TinyLlama(CONFIG).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cache_dir=None))
    return model, runner


def double(module, args, output):
    return output * 2


def shift(module, args):
    return (args[0] + 1.0, *args[1:])


HOOKS = {
    "submodule forward hook": lambda model: model.layers[0].register_forward_hook(double),
    "submodule pre-hook": lambda model: model.layers[1].register_forward_pre_hook(shift),
    "the model's forward hook": lambda model: model.register_forward_hook(double),
    "a global forward hook": lambda model: register_module_forward_hook(
        lambda module, args, output: output * 2 if module is model.norm else None),
}


@pytest.mark.parametrize("frontend", [*FRONTENDS, "auto"])
@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_a_hook_added_after_the_first_call_runs_and_its_removal_is_seen(frontend, hook):
    model, runner = build(frontend)
    ours, theirs = model.make_kv_cache(), model.make_kv_cache()
    ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        runner(ids[:5], torch.arange(5), ours)
        model(ids[:5], torch.arange(5), theirs)
        handle = HOOKS[hook](model)
        try:
            with pytest.warns(UserWarning, match="forward hooks changed since the first call"):
                got = runner(ids[5:8], torch.arange(5, 8), ours)
            want = model(ids[5:8], torch.arange(5, 8), theirs)
        finally:
            handle.remove()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(ours, theirs)
        eager_calls = runner.stats["eager_calls"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the hook gone: the graphs serve again, silently
            got = runner(ids[8:11], torch.arange(8, 11), ours)
        want = model(ids[8:11], torch.arange(8, 11), theirs)
    torch.testing.assert_close(got, want)
    assert runner.stats["eager_calls"] == eager_calls


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_hook_present_at_the_first_call_and_removed_after_is_seen(frontend):
    torch.manual_seed(0)
    model = TinyLlama(CONFIG).eval()
    handle = model.layers[0].register_forward_hook(double)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cache_dir=None))
    ours, theirs = model.make_kv_cache(), model.make_kv_cache()
    ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first call names the hook
        runner(ids[:5], torch.arange(5), ours)
        model(ids[:5], torch.arange(5), theirs)
    handle.remove()
    with torch.no_grad(), pytest.warns(UserWarning, match=r"removed layers\.0 \(forward_hook\): double"):
        got = runner(ids[5:8], torch.arange(5, 8), ours)
    torch.testing.assert_close(got, model(ids[5:8], torch.arange(5, 8), theirs))


def test_a_tensor_hook_registered_elsewhere_changes_nothing():
    model, runner = build("dynamo")
    cache = model.make_kv_cache()
    with torch.no_grad():
        runner(torch.arange(5), torch.arange(5), cache)
    torch.zeros(2, requires_grad=True).register_hook(lambda grad: grad)  # moves torch's handle counter
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        runner(torch.arange(3), torch.arange(5, 8), cache)
    assert runner.stats["eager_calls"] == 0


def test_hooks_on_the_compiled_module_itself_are_refused_by_dynamo_and_run_by_breakable():
    torch.manual_seed(0)
    model = TinyLlama(CONFIG).eval()
    model.register_forward_hook(double)
    with pytest.raises(ForwardRefused, match="hooks around its call") as info:
        with torch.no_grad():
            piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend="dynamo", cache_dir=None))(
                torch.arange(5), torch.arange(5), model.make_kv_cache())
    assert info.value.kind == "module_hook"
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, cache_dir=None))
    ours, theirs = model.make_kv_cache(), model.make_kv_cache()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for start, stop in ((0, 5), (5, 8)):
            got = runner(torch.arange(start, stop), torch.arange(start, stop), ours)
            torch.testing.assert_close(got, model(torch.arange(start, stop), torch.arange(start, stop), theirs))
    assert runner.stats["frontend"] == "breakable"


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_call_that_falls_back_to_eager_returns_ordinary_tensors(frontend):
    """A sampler's in-place post-processing (``logits.div_(temperature)``) works on every call's output."""
    model, runner = build(frontend)
    cache = model.make_kv_cache()
    with torch.no_grad():
        runner(torch.arange(5), torch.arange(5), cache).div_(0.7)
        with pytest.warns(UserWarning, match="runs? the model's own forward|own forward"):
            logits = runner(torch.arange(2, dtype=torch.int32), torch.arange(5, 7), cache)
    assert not logits.is_inference()
    logits.div_(0.7)
    assert runner.stats["eager_calls"] == 1


class BatchOfOne(TinyLlama):
    def forward(self, input_ids, positions, kv_cache):
        return super().forward(input_ids, positions, kv_cache)[None]  # transformers' [1, T, V]


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_outputs_with_the_tokens_in_dimension_1_keep_full_graphs(frontend):
    torch.manual_seed(0)
    model = BatchOfOne(CONFIG).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cache_dir=None))
    ours, theirs = model.make_kv_cache(), model.make_kv_cache()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "full graphs turned off" warning
        for start, stop in ((0, 5), (5, 8), (8, 9)):
            got = runner(torch.arange(start, stop), torch.arange(start, stop), ours)
            want = model(torch.arange(start, stop), torch.arange(start, stop), theirs)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want)
    assert runner.stats["full_sizes"], dict(runner.stats)


class Biased(TinyLlama):
    def forward(self, input_ids, positions, kv_cache, logit_bias=None):
        logits = super().forward(input_ids, positions, kv_cache)
        return logits if logit_bias is None else logits + logit_bias


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_an_optional_tensor_first_given_later_may_be_a_new_tensor_on_every_call(frontend):
    """A per-request logit bias absent at the first call: calls with it run the model's own forward (no graph
    reads it), so each may pass another tensor."""
    torch.manual_seed(0)
    model = Biased(CONFIG).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cache_dir=None))
    ours, theirs = model.make_kv_cache(), model.make_kv_cache()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner(torch.arange(5), torch.arange(5), ours)
        model(torch.arange(5), torch.arange(5), theirs)
        for start, bias in ((5, 0.0), (7, 1.0), (9, -2.0)):
            bias = torch.full((CONFIG.vocab_size,), bias)
            got = runner(torch.arange(2), torch.arange(start, start + 2), ours, logit_bias=bias)
            torch.testing.assert_close(got, model(torch.arange(2), torch.arange(start, start + 2), theirs, bias))


class Sampling(TinyLlama):
    def forward(self, input_ids, positions, kv_cache):
        logits = super().forward(input_ids, positions, kv_cache)
        return logits + torch.rand_like(logits)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_forward_that_draws_random_numbers_is_named_in_a_warning(frontend):
    torch.manual_seed(0)
    model = Sampling(CONFIG).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cache_dir=None))
    with torch.no_grad(), pytest.warns(UserWarning, match="draws random numbers.*moves on by the padded count"):
        runner(torch.arange(5), torch.arange(5), model.make_kv_cache())


def test_hooks_on_the_compiled_module_are_refused_where_breakable_compiles_its_regions():
    """Inductor's regions compile the module's forward, not its call: the hook would not be in the graphs."""
    torch.manual_seed(0)
    model = TinyLlama(CONFIG).eval()
    model.register_forward_hook(double)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend="breakable",
                                                              compiler="inductor", cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused, match="regions Inductor compiles") as info:
        runner(torch.arange(5), torch.arange(5), model.make_kv_cache())
    assert info.value.kind == "module_hook"


def scale_input_embeddings(module, args):
    """A pre-hook written for the positional call ``model(input_ids, positions, cache)``."""
    return (args[0] % 32, *args[1:])


def test_a_positional_pre_hook_on_the_compiled_module_is_refused_by_breakable_and_a_keyword_one_runs():
    torch.manual_seed(0)
    model = TinyLlama(CONFIG).eval()
    handle = model.register_forward_pre_hook(scale_input_embeddings)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend="breakable", cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused, match="with_kwargs=True") as info:
        runner(torch.arange(5), torch.arange(5), model.make_kv_cache())
    assert info.value.kind == "module_hook"
    handle.remove()
    model.register_forward_pre_hook(lambda module, args, kwargs: (args, {**kwargs, "input_ids": kwargs["input_ids"]
                                                                         % 32}), with_kwargs=True)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend="breakable", cache_dir=None))
    ours, theirs = model.make_kv_cache(), model.make_kv_cache()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for start, stop in ((0, 5), (5, 8), (8, 9)):
            ids = torch.arange(start, stop) + 40
            got = runner(input_ids=ids, positions=torch.arange(start, stop), kv_cache=ours)
            want = model(input_ids=ids, positions=torch.arange(start, stop), kv_cache=theirs)
            torch.testing.assert_close(got, want)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_call_after_a_pre_hook_was_added_runs_the_model_as_the_caller_called_it(frontend):
    """The model's own forward serves it, called with the caller's positional arguments: the hook sees them."""
    model, runner = build(frontend)
    ours, theirs = model.make_kv_cache(), model.make_kv_cache()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = torch.arange(9) + 40
        runner(ids[:5], torch.arange(5), ours)
        model(ids[:5], torch.arange(5), theirs)
        model.register_forward_pre_hook(scale_input_embeddings)
        got = runner(ids[5:8], torch.arange(5, 8), ours)
        want = model(ids[5:8], torch.arange(5, 8), theirs)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(ours, theirs)
    assert runner.stats["eager_calls"] == 1


def test_a_global_pre_hook_of_torchs_module_tracker_is_not_refused():
    from torch.utils.module_tracker import ModuleTracker

    model, runner = build("breakable")
    with torch.no_grad(), ModuleTracker():
        out = runner(torch.arange(5), torch.arange(5), model.make_kv_cache())
    torch.testing.assert_close(out, model(torch.arange(5), torch.arange(5), model.make_kv_cache()))
