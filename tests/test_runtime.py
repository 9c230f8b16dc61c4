"""The piecewise pipeline on CPU: same trace, split, padding and buffers as on CUDA, pieces run without graphs."""

import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import piecewise
from piecewise.models import example


def rel_error(out, ref):
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def run_pair(model, runner, tokens, cache, start=0):
    ids = torch.randint(0, model.config.vocab_size, (tokens,))
    positions = torch.arange(tokens) + start
    reference_cache = cache.clone()
    ref = model(ids, positions, reference_cache)
    out = runner(ids, positions, cache)
    return out, ref, cache, reference_cache


@pytest.mark.parametrize("layers", [2, 4])
def test_example_equals_eager_for_every_token_count(layers):
    model, (ids, positions, cache) = example(tokens=5, num_layers=layers)
    config = piecewise.CaptureConfig(max_tokens=24, graph_mode="piecewise")  # the piecewise mechanics
    runner = piecewise.compile(model, config)
    with torch.no_grad():
        for tokens in range(1, config.max_tokens + 4):
            out, ref, cache, reference_cache = run_pair(model, runner, tokens, cache, start=tokens % 5)
            assert out.shape == ref.shape
            assert rel_error(out, ref) <= 1e-5, tokens
            assert rel_error(cache, reference_cache) <= 1e-5, tokens
    stats = runner.stats
    assert stats["pieces"] == layers + 1
    assert stats["splitting_op_calls"] == layers
    assert stats["traces"] == 1
    assert stats["cuda_graphs"] is False and stats["graphs"] == 0 and stats["replays"] == 0
    assert stats["fallback_calls"] == 3
    # every call skips Dynamo's frame hook (guard check + transformed code): the first call's padding check
    # traced the forward
    assert stats["direct_calls"] == config.max_tokens + 3
    assert stats["prewarm_seconds"] > 0
    phases = stats["first_call_seconds"]  # the order they ran in; Dynamo traced inside the padding check
    assert list(phases)[:5] == ["warm-up", "cache", "front-end", "padding check", "one-token check"]
    assert phases["warm-up"] >= stats["prewarm_seconds"] and phases["padding check"] >= stats["compile_seconds"]
    assert "capture" not in phases  # no CUDA: nothing captured
    assert runner.token_arguments == {"input_ids": 0, "positions": 0}


def test_released_runner_keeps_computing_the_same_outputs():
    model, (ids, positions, cache) = example(tokens=5, num_layers=2)
    with torch.no_grad():
        reference_cache = cache.clone()
        expected = model(ids, positions, reference_cache)
        with piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, graph_mode="piecewise")) as runner:
            runner(ids, positions, cache)
        out = runner(ids, positions, cache)  # after release: the pieces, padded, without graphs (same positions)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(cache, reference_cache)
    assert runner.stats["cuda_graphs"] is False and runner.stats["padded_calls"] == 2


def test_zero_tokens_is_an_error():
    model, (ids, positions, cache) = example(tokens=3)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    runner(ids, positions, cache)
    with pytest.raises(ValueError, match="0 tokens"):
        runner(ids[:0], positions[:0], cache)


def test_moved_static_buffer_is_named():
    model, (ids, positions, cache) = example(tokens=3)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    runner(ids, positions, cache)
    with pytest.raises(ValueError, match="static argument 'kv_cache'.*copy_"):
        runner(ids, positions, cache.clone())


def test_token_arguments_must_agree():
    model, (ids, positions, cache) = example(tokens=3)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8), dynamic={"input_ids": 0, "positions": 0})
    with pytest.raises(ValueError, match="'positions' has 2 tokens"):
        runner(ids, positions[:2], cache)


def test_dynamic_must_name_forward_arguments():
    model, _ = example(tokens=3)
    with pytest.raises(ValueError, match="'tokens'.*input_ids"):
        piecewise.compile(model, dynamic={"tokens": 0})


def test_outputs_are_not_overwritten_by_the_next_call():
    model, (ids, positions, cache) = example(tokens=3)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    first = runner(ids, positions, cache)
    kept = first.clone()
    runner(ids.flip(0), positions, cache)
    assert torch.equal(first, kept)


class NanPadding(torch.nn.Module):
    """A piece that turns zero pad rows into NaN, then a splitting op, then a piece: NaN must not leak."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8, bias=False)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = x / x.norm(dim=-1, keepdim=True)  # 0/0 = NaN on zero pad rows
        h = record_rows(self.inp(h))
        return self.out(h) + h


seen_rows = []


@piecewise.opaque_op("test_runtime::record_rows", split=True)
def record_rows(x: torch.Tensor) -> torch.Tensor:
    ctx = piecewise.context()
    seen_rows.append((x.shape[0], ctx.num_tokens if ctx else None, ctx.padded_tokens if ctx else None))
    return x * 3


def test_padding_never_leaks_and_splitting_ops_see_real_rows():
    model = NanPadding()
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[8], max_tokens=8))
    with torch.no_grad():
        for tokens in (7, 3, 5, 8, 1):
            x = torch.randn(tokens, 8) + 0.1
            seen_rows.clear()
            out = runner(x)
            assert seen_rows[-1] == (tokens, tokens, 8)  # (an eager warm-up call may come first)
            assert torch.isfinite(out).all()
            torch.testing.assert_close(out, model(x))
            buffer = runner.frontend.graph_runners[0].splitting_ops[0].split.buffers[0].buffer
            assert torch.count_nonzero(buffer[tokens:]) == 0, "rows past the real tokens must read zero"


def test_forward_that_branches_on_the_token_count_is_refused():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            if x.shape[0] > 4:
                return self.linear(x)
            return x

    runner = piecewise.compile(Branchy(), piecewise.CaptureConfig(max_tokens=8, frontend="dynamo"))
    with pytest.raises(ValueError, match=r"depends on the token count.*x.shape\[0\] > 4.*capture size"):
        runner(torch.randn(6, 4))
    # auto: Dynamo's refusal moves it to breakable, which captures every size and finds where the path changes:
    # between 4 and 8, where calls of 5..7 tokens would take the path of 8
    runner = piecewise.compile(Branchy(), piecewise.CaptureConfig(max_tokens=8))
    with pytest.warns(UserWarning, match="runs with the breakable front-end"), \
            pytest.raises(ValueError, match=r"another path at 4 tokens than at 8.*`return self.linear\(x\)`.*calls of "
                                            r"5..7 tokens, padded to 8"):
        runner(torch.randn(6, 4))


@piecewise.opaque_op("piecewise_tests::running_max", fake=lambda x, store: torch.empty_like(x),
                      mutates_args=("store",), split=True)
def running_max(x: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
    """Keeps the column maxima of every call so far in ``store`` [1, 1, 4] (state kept across calls, like a KV
    cache; idempotent for a repeated call, as the first call's warm-up and capture runs require), returns
    x + store."""
    torch.maximum(store, x.max(0).values, out=store)
    return x + store.view(-1)


class WithOptionalState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, store=None, weights=None):
        h = self.first(x)
        if store is not None:
            h = running_max(h, store)
        if weights is not None:
            h = h * weights[:, None]
        return self.second(h)


def test_a_state_tensor_first_passed_after_the_first_call_is_updated_in_place():
    """First call without the state (None), then with it: another variant of the call, which runs the model's own
    forward (one warning naming the argument) and so reads and writes the caller's tensor in place."""
    torch.manual_seed(0)
    model = WithOptionalState()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    store, expected_store = torch.full((1, 1, 4), -9.0), torch.full((1, 1, 4), -9.0)
    inputs = [torch.randn(tokens, 4) for tokens in (5, 1, 1, 3, 1)]
    with torch.no_grad():
        x = torch.randn(3, 4)
        torch.testing.assert_close(runner(x), model(x))
        with pytest.warns(UserWarning, match="argument 'store' is given now and was not at the first call"):
            runner(inputs[0], store)
        model(inputs[0], expected_store)
        for x in inputs[1:]:
            torch.testing.assert_close(runner(x, store), model(x, expected_store))
            torch.testing.assert_close(store, expected_store)
    assert runner.stats["traces"] == 1 and runner.stats["eager_calls"] == len(inputs)
    # a per-token tensor first given later is a token argument, as at the first call: a new one each call
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tokens in (4, 2, 4):
            x, weights = torch.randn(tokens, 4), torch.rand(tokens)
            torch.testing.assert_close(runner(x, store, weights), model(x, expected_store, weights))
            torch.testing.assert_close(store, expected_store)
    assert runner.token_arguments == {"x": 0, "weights": 0}
    # a first call with the state captures that variant, which every later call passes; the graphs update it
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    store, expected_store = torch.full((1, 1, 4), -9.0), torch.full((1, 1, 4), -9.0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for tokens in (3, 1, 3, 1):
            x = torch.randn(tokens, 4)
            torch.testing.assert_close(runner(x, store), model(x, expected_store))
            torch.testing.assert_close(store, expected_store)
    assert runner.stats["traces"] == 1 and runner.stats["eager_calls"] == 0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(st.tuples(st.integers(1, 10), st.booleans(), st.booleans()), min_size=2, max_size=5),
       seed=st.integers(0, 2**16))
def test_any_sequence_of_calls_with_optional_state_equals_eager(calls, seed):
    """Calls with and without the optional state and a per-token argument, in any order, at token counts
    below and above max_tokens: every output and the state equal eager's. What the first call passes, every
    call passes (the captured variant's arguments); what it leaves out, a later call may pass or not."""
    first_store, first_weights = calls[0][1], calls[0][2]
    calls = [(tokens, store or first_store, weights or first_weights) for tokens, store, weights in calls]
    torch.manual_seed(seed)
    model = WithOptionalState()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    store, expected_store = torch.full((1, 1, 4), -9.0), torch.full((1, 1, 4), -9.0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each new combination of arguments retraces once, with a warning
        for tokens, with_store, with_weights in calls:
            x = torch.randn(tokens, 4)
            weights = torch.rand(tokens) if with_weights else None
            out = runner(x, store if with_store else None, weights)
            torch.testing.assert_close(out, model(x, expected_store if with_store else None, weights))
            torch.testing.assert_close(store, expected_store)


def test_a_write_into_what_was_taken_for_a_token_argument_is_refused():
    """A 1-D state of 4 values next to a 4-token input looks like a token argument; its writes would land in
    a padded copy. The trace refuses, naming the op, the argument and the remedy; dynamic= fixes it."""
    model = WithOptionalState()
    store = torch.zeros(4)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad(), pytest.raises(ValueError, match=r"running_max writes in place into argument 'store'.*"
                                                          r"dynamic=\{\.\.\.\} naming only the real token"):
        runner(torch.randn(4, 4), store.view(1, 1, 4).view(4))
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8), dynamic={"x": 0})
    expected_store = store.clone()
    with torch.no_grad():
        for tokens in (4, 2):
            x = torch.randn(tokens, 4)
            torch.testing.assert_close(runner(x, store), model(x, expected_store))
    torch.testing.assert_close(store, expected_store)


def test_changed_python_argument_retraces_with_one_warning_and_stays_correct():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x, scale: float):
            return self.linear(x) * scale

    model = Scaled()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(runner(x, 2.0), model(x, 2.0))
        with pytest.warns(UserWarning, match=r"argument 'scale' is 3.0 and was 2.0 at the first call.*model's own "
                                             r"forward"):
            out = runner(x, 3.0)
        torch.testing.assert_close(out, model(x, 3.0))
    assert runner.stats["traces"] == 1 and runner.stats["eager_calls"] == 1


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.scale = 2.0

    def forward(self, x):
        return self.linear(x) * self.scale


def test_changed_module_attribute_is_caught_by_the_guards_of_the_direct_call():
    model = Scaled()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    x = torch.randn(3, 4)
    with torch.no_grad():
        runner(x)
        torch.testing.assert_close(runner(x), model(x))
        assert runner.stats["direct_calls"] == 2
        model.scale = 3.0
        with pytest.warns(UserWarning, match="traced again"):
            out = runner(x)
        torch.testing.assert_close(out, model(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # global state is checked on every call
            with pytest.warns(UserWarning, match=r"global state changed since the first call \(autocast"):
                out = runner(x)
            ref = model(x)
        assert out.dtype == ref.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref)
    # the call after the change ran the model's own forward (the new trace's padding was never checked)
    assert runner.stats["traces"] == 2 and runner.stats["direct_calls"] == 2 and runner.stats["eager_calls"] == 2


def test_model_state_changed_after_the_first_call_on_every_call_ends_in_the_named_error_not_dynamos():
    """After the first call each change traces again with a warning naming the guard; at Dynamo's recompile limit
    the user gets the state_guard error, not Dynamo's hard failure."""
    from piecewise.errors import ForwardRefused

    model = Scaled()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo"))
    x = torch.randn(3, 4)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner(x)
        with pytest.raises(ForwardRefused, match="Python state changes from call to call") as refused:
            for step in range(2, 20):
                model.scale = float(step)
                torch.testing.assert_close(runner(x), model(x))
    assert refused.value.kind == "state_guard" and 2 < step < 19
    retraced = [str(w.message) for w in caught if "traced again" in str(w.message)]
    assert retraced and all("a guard on model state failed: `" in text and "scale" in text for text in retraced)



def test_argument_values_changing_past_dynamos_recompile_limit_run_eagerly_with_a_short_warning():
    """SGLang's ForwardBatch: a Python field that changes between calls (a mode, a batch size) traces again each
    time; past Dynamo's recompile limit such calls run the model's own forward (right numbers, counted, no error
    partway through serving), and the warnings name the field in a line, not the object's repr or a tensor's values."""
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        mode: int
        cache: list

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x, batch):
            return self.linear(x) * batch.mode + batch.cache[0].sum()

    model = Model()
    cache = [torch.randn(64, 64)]
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo"))
    x = torch.randn(3, 4)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mode in [1, *range(2, 16)]:
            torch.testing.assert_close(runner(x, Batch(mode, cache)), model(x, Batch(mode, cache)))
    assert runner.stats["eager_calls"] == 14
    messages = [str(w.message) for w in caught if "traced again" in str(w.message)]
    assert any("recompile limit" in text for text in messages), messages
    assert all("argument 'batch'.mode: 1 -> " in text and len(text) < 800 and "tensor(" not in text
               for text in messages), messages


_CONTEXT: dict = {}


class _ReadsAGlobalPerTokenTensor(torch.nn.Module):
    """vLLM's forward context read outside any splitting op: a per-token scale taken from a global."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) * _CONTEXT["scale"][:, None]


def test_a_later_trace_that_fails_on_the_padded_rows_runs_the_models_own_forward():
    """A one-token first call reads a global per-token tensor of one row (it broadcasts, so nothing shows); a later
    call of more tokens traces again and that trace fails on its padded rows (the global has the real rows), or is
    refused: each such call runs the model's own forward with a warning, no error partway through serving."""
    torch.manual_seed(0)
    model = _ReadsAGlobalPerTokenTensor()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo", cache_dir=None))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens in (1, 3, 5, 3):
            x = torch.randn(tokens, 4)
            _CONTEXT["scale"] = torch.rand(tokens) + 0.5
            torch.testing.assert_close(runner(x), model(x))
    assert runner.stats["eager_calls"] == 3
    assert any("traced again after the first call" in str(w.message) and "cannot serve padded calls"
               in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_direct_call_keeps_defaults_keyword_arguments_and_closures():
    offset = torch.randn(4)

    class WithDefaults(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x, scale: float = 2.0, *, shift: torch.Tensor | None = None):
            out = self.linear(x) * scale + offset  # offset: a closure cell of the forward
            return out if shift is None else out + shift

    model = WithDefaults()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    shift = torch.randn(4)
    with torch.no_grad():
        for tokens in (3, 5, 1):
            x = torch.randn(tokens, 4)
            torch.testing.assert_close(runner(x, shift=shift), model(x, shift=shift))
        assert runner.stats["traces"] == 1 and runner.stats["direct_calls"] == 3
        offset.add_(1.0)  # the closure's tensor changed in place: the graph reads it, no retrace needed
        x = torch.randn(2, 4)
        torch.testing.assert_close(runner(x, shift=shift), model(x, shift=shift))
        with pytest.raises(ValueError, match="static argument 'shift' was a tensor at capture and is not given"):
            runner(x)


def test_direct_call_that_cannot_check_guards_falls_back_to_dynamo(caplog):
    class Doubled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x) * 2

    model = Doubled()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo"))
    x = torch.randn(3, 4)
    with torch.no_grad():
        runner(x)

        def incompatible(frame_locals):  # what a torch with another guard-check signature would do
            raise TypeError("check() needs a frame")

        runner.frontend.tracer.direct.check = incompatible
        for _ in range(2):
            torch.testing.assert_close(runner(x), model(x))
    assert runner.stats["direct_calls"] == 1 and runner.stats["traces"] == 1  # the first call's, before the swap
    assert "calls go through Dynamo" in caplog.text


def test_guard_filter_keeps_argument_attribute_and_structure_guards_and_drops_the_modules_tensors():
    from types import SimpleNamespace as Entry

    from piecewise._compat import drop_shape_guards

    cases = {
        ("TENSOR_MATCH", "input_ids"): True,  # forward arguments
        ("TYPE_MATCH", "scale"): True,
        ("CONSTANT_MATCH", "self.eps"): True,  # values of plain module attributes
        ("EQUALS_MATCH", "self._modules['layers']._modules['0'].index"): True,
        ("GLOBAL_STATE", ""): True,
        ("CLOSURE_MATCH", "G['rotary']"): True,
        ("SHAPE_ENV", ""): False,  # one trace serves every token count
        ("TENSOR_MATCH", "self._modules['qkv']._parameters['weight']"): False,  # read by address
        ("CONSTANT_MATCH", "self._modules['qkv']._parameters['bias']"): False,  # ParameterWatch's
        ("DICT_KEYS_MATCH", "self._modules['layers']._modules"): False,
        ("DUPLICATE_INPUT", "self._modules['lm_head']._parameters['weight']"): False,
        ("TYPE_MATCH", "self._modules['layers']._modules['3']"): True,  # module structure: a swapped object
        ("ID_MATCH", "self.mode"): True,  # an enum
        ("NOT_PRESENT_IN_GENERIC_DICT", "self._modules['head']"): True,  # a forward patched on the instance
        ("EMPTY_NN_MODULE_HOOKS_DICT", "self._modules['qkv']._forward_hooks"): True,  # a hook registered later
    }
    entries = [Entry(guard_type=kind, name=name) for kind, name in cases]
    assert drop_shape_guards(entries) == list(cases.values())


def test_no_splitting_ops_still_runs_cache_writes_on_the_real_rows():
    """With splitting_ops=() the attention op would be captured inside a piece, where it would also write the
    KV cache for the padding rows (position 0 of each pad row). It writes a static tensor, so it is cut out
    and runs eagerly on the real rows all the same; without cache writes the model is one piece."""
    model, (ids, positions, cache) = example(tokens=4, num_layers=2)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, splitting_ops=()))
    with torch.no_grad():
        for tokens, start in ((3, 0), (1, 3), (5, 4)):  # padded to 4, 1, 8
            out, ref, cache, reference_cache = run_pair(model, runner, tokens, cache, start=start)
            assert rel_error(out, ref) <= 1e-5
            assert rel_error(cache, reference_cache) <= 1e-6
    assert runner.stats["eager_writes"] == 2 and runner.stats["pieces"] == 3

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return record_rows(self.linear(x)).relu()

    plain = piecewise.compile(Plain(), piecewise.CaptureConfig(max_tokens=8, splitting_ops=()))
    with torch.no_grad():
        plain(torch.randn(3, 4))
    assert plain.stats["pieces"] == 1 and plain.stats["splitting_op_calls"] == 0


def test_keyword_arguments_and_tuple_outputs():
    class TwoOutputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 6)

        def forward(self, x, bias):
            h = record_rows(self.linear(x))
            return h + bias, h.sum()

    model = TwoOutputs()
    bias = torch.randn(6)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    x = torch.randn(3, 4)
    with torch.no_grad():
        out, total = runner(x=x, bias=bias)
        ref, ref_total = model(x, bias)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(total, ref_total)


def test_inductor_pieces_trace_once_for_every_size():
    model, (ids, positions, cache) = example(tokens=3, num_layers=1, hidden_size=32, intermediate_size=64)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, compiler="inductor"))
    with torch.no_grad():
        for tokens in (8, 1, 3, 9):
            out, ref, cache, reference_cache = run_pair(model, runner, tokens, cache)
            assert rel_error(out, ref) <= 1e-4
    assert runner.stats["traces"] == 1 and runner.stats["pieces"] == 2


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([8, 16]),
    max_tokens=st.integers(1, 20),
    token_counts=st.lists(st.integers(1, 24), min_size=1, max_size=5),
)
def test_random_shapes_and_sizes_equal_eager(layers, kv_heads, group, head_dim, max_tokens, token_counts):
    heads = kv_heads * group
    model, (ids, positions, cache) = example(
        tokens=1, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        hidden_size=heads * head_dim, intermediate_size=48, vocab_size=64, max_seq_len=32,
    )
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=max_tokens))
    with torch.no_grad():
        for tokens in token_counts:
            out, ref, cache, reference_cache = run_pair(model, runner, tokens, cache, start=3)
            assert rel_error(out, ref) <= 1e-5
            assert rel_error(cache, reference_cache) <= 1e-5
    assert runner.stats["traces"] == 1
    assert runner.stats["pieces"] == layers + 1


def test_cache_writes_in_traced_code_run_on_the_real_rows():
    """`cache[...].index_copy_(0, positions, k)` and `cache[1][positions] = v` written in the forward itself:
    inside a piece they would also run for the padding rows (positions 0), overwriting position 0. They are
    cut out and run eagerly on the real rows; outputs and cache equal eager's at every padded size."""
    from fixtures.state_models import CacheWriter

    torch.manual_seed(0)
    model = CacheWriter()
    cache, expected = torch.zeros(2, 32, 8), torch.zeros(2, 32, 8)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    start = 0
    with torch.no_grad():
        for tokens in (3, 1, 5, 2, 7, 10):  # padded to 4, 1, 8, 2, 8; 10 runs unpadded
            x, positions = torch.randn(tokens, 8), torch.arange(start, start + tokens)
            torch.testing.assert_close(runner(x, positions, cache), model(x, positions, expected))
            torch.testing.assert_close(cache, expected)
            start += tokens
    assert runner.stats["eager_writes"] == 2 and runner.stats["pieces"] == 3


def test_a_batch_first_model_with_its_cache_in_buffers_runs_with_tokens_first():
    """gpt-fast style: [1, T] inside, KV caches in buffers written at ``input_pos`` with the tokens in dimension 2
    of the written values. Called with the tokens first, the cache writes are cut out of the pieces and run on
    the real tokens, cut along that dimension (they failed with a shape mismatch when padded before)."""
    from fixtures.state_models import BatchFirstCache, TokensFirst

    torch.manual_seed(0)
    model = BatchFirstCache().eval()
    ids = torch.randint(0, 100, (11,))

    def generate(call):
        for layer in model.layers:
            layer.k.zero_()
            layer.v.zero_()
        with torch.no_grad():
            steps = [call(ids[:6], torch.arange(6)), call(ids[6:9], torch.arange(6, 9))]  # padded to 8 and 4
            steps += [call(ids[p : p + 1], torch.tensor([p])) for p in range(9, 11)]
        return torch.cat(steps), [layer.k.clone() for layer in model.layers]

    wrapped = TokensFirst(model)
    expected, expected_cache = generate(wrapped)
    runner = piecewise.compile(wrapped, piecewise.CaptureConfig(max_tokens=8))
    got, cache = generate(runner)
    torch.testing.assert_close(got, expected)
    for a, b in zip(cache, expected_cache):
        torch.testing.assert_close(a, b)
    assert runner.stats["eager_writes"] == 4 and runner.stats["padded_calls"] >= 2 and runner.stats["traces"] == 1


def test_a_one_token_batch_first_first_call_is_told_the_batch_first_naming():
    """gpt-fast decoding first ([1, 1] ids, [1] positions): one sequence of one token, ambiguous; the refusal names
    the naming that takes the ids batch-first, and that naming serves the model."""
    from fixtures.state_models import BatchFirstCache

    from piecewise.errors import ForwardRefused

    torch.manual_seed(0)
    model = BatchFirstCache().eval()
    ids = torch.randint(0, 100, (1, 1))
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=None))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ForwardRefused, match=r"\[batch, tokens\].*dynamic=\{'idx': 1, 'input_pos': 0\}"):
            runner(ids, torch.tensor([0]))
        named = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=None),
                                  dynamic={"idx": 1, "input_pos": 0})
        got = named(ids, torch.tensor([0]))
    for layer in model.layers:
        layer.k.zero_()
        layer.v.zero_()
    with torch.no_grad():
        torch.testing.assert_close(got, model(ids, torch.tensor([0])))


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("dynamic,batch", [(None, 1), ({"idx": 1, "input_pos": 0}, 1), (None, 2)])
def test_a_batch_first_model_runs_called_in_its_own_layout(frontend, dynamic, batch):
    """gpt-fast called as it is: ids [batch, T] (the tokens in dimension 1, found by themselves — beside positions
    of T rows — or named), positions [T], caches in buffers of the batch's rows. Prefill, a second chunk and decode
    steps equal eager, caches included."""
    from fixtures.state_models import BatchFirstCache

    torch.manual_seed(0)
    model = BatchFirstCache(batch=batch).eval()
    ids = torch.randint(0, 100, (batch, 11))

    def generate(call):
        for layer in model.layers:
            layer.k.zero_()
            layer.v.zero_()
        with torch.no_grad():
            steps = [call(ids[:, :6], torch.arange(6)), call(ids[:, 6:9], torch.arange(6, 9))]  # padded to 8 and 4
            steps += [call(ids[:, p : p + 1], torch.tensor([p])) for p in range(9, 11)]
        return torch.cat(steps, dim=1), [layer.k.clone() for layer in model.layers]

    expected, expected_cache = generate(model)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None),
                               dynamic=dynamic)
    got, cache = generate(runner)
    torch.testing.assert_close(got, expected)
    for a, b in zip(cache, expected_cache):
        torch.testing.assert_close(a, b)
    assert runner.token_arguments == {"idx": 1, "input_pos": 0}
    assert runner.stats["padded_calls"] >= 2 and runner.stats["eager_calls"] == 0
    if frontend == "dynamo":  # the compiled forward is called without Dynamo's frame hook, as for any model
        assert runner.frontend.tracer.direct is not None and runner.frontend.tracer.last_direct


class PerSequenceTemperature(torch.nn.Module):
    """A batch-first model with a per-sequence argument of as many rows as the batch: the tokens' dimension is
    ambiguous, and piecewise takes dimension 0 of the ids."""

    def __init__(self):
        super().__init__()
        from fixtures.state_models import BatchFirstCache

        self.inner = BatchFirstCache(batch=2)

    def forward(self, idx, input_pos, temperature):
        return self.inner(idx, input_pos) / temperature[:, None, None]


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_refusal_from_the_token_dimension_taken_by_default_says_which_and_how_to_name_another(frontend):
    torch.manual_seed(0)
    runner = piecewise.compile(PerSequenceTemperature().eval(),
                               piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    from piecewise.errors import ForwardRefused

    with torch.no_grad(), pytest.raises(ForwardRefused) as refused:
        runner(torch.randint(0, 100, (2, 5)), torch.arange(5), torch.ones(2))
    assert "piecewise took dimension 0 of 'idx' (shape (2, 5) at the first call) for the tokens by itself" \
        in str(refused.value)
    assert "dynamic={'idx': 1, ...}" in str(refused.value)


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return x * self.scale


@pytest.mark.parametrize("first", [(3, 4), (1, 4)])
def test_a_token_arguments_other_dimension_that_changes_runs_eagerly_naming_it(first):
    """The buffers a token argument is staged in have the first call's other dimensions: a call that changes one
    runs the model's own forward, with a warning naming the dimension (and, where the first call had one row, how
    to name a batch-first token dimension)."""
    runner = piecewise.compile(Scale(), piecewise.CaptureConfig(max_tokens=8, cache_dir=None))
    with torch.no_grad():
        runner(torch.randn(*first))
        x = torch.randn(first[0], 6)
        with pytest.warns(UserWarning, match=rf"argument 'x' has shape \({first[0]}, 6\) and had \({first[0]}, 4\) "
                                             rf"at the first call \(dimension 1\); its token dimension is 0") as caught:
            torch.testing.assert_close(runner(x), x * 2)
    hint = "if dimension 1 carries the tokens, pass dynamic={'x': 1, ...}"
    assert (hint in str(caught[0].message)) == (first[0] == 1)  # [T, hidden] activations: no hint
    with torch.no_grad():
        for x, dims in ((torch.randn(first[0], 4, 1), 3), (torch.randn(first[0]), 1)):
            with pytest.warns(UserWarning, match=rf"argument 'x' has {dims} dimensions, shape"):
                torch.testing.assert_close(runner(x), x * 2)
    assert runner.stats["eager_calls"] == 3


class Embeds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)

    def forward(self, input_ids):
        return self.embed(input_ids)


def test_batch_ids_whose_length_changes_are_told_the_dynamic_that_names_it():
    """transformers-style ids [B, T] with B > 1: dimension 0 is taken for the tokens, so a longer T runs eagerly;
    the warning names the dimension to pass."""
    model = Embeds()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=None))
    with torch.no_grad():
        runner(torch.randint(0, 16, (2, 5)))
        ids = torch.randint(0, 16, (2, 7))
        with pytest.warns(UserWarning, match=r"dimension 1\); its token dimension is 0, the only one the graphs serve "
                                             r"other sizes of; if dimension 1 carries the tokens, pass "
                                             r"dynamic=\{'input_ids': 1, ...\}"):
            torch.testing.assert_close(runner(ids), model(ids))


@pytest.mark.parametrize("update", ["+=", "add_", "index_put_accumulate"])
def test_state_updated_from_its_own_value_is_refused(update):
    from fixtures.state_models import StepCounter

    model = StepCounter()
    if update != "+=":
        def forward(x):
            if update == "add_":
                model.steps.add_(1)
            else:
                model.steps.view(1).index_put_((torch.zeros(1, dtype=torch.long),), torch.ones(1), accumulate=True)
            return model.linear(x) * 2
        model.forward = forward
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad(), pytest.raises(ValueError) as failure:
        runner(torch.randn(3, 8))
    message = str(failure.value)
    assert "in place from its own value" in message and "steps" in message
    assert "piecewise.context().rehearsal" in message and "opaque_op(..., split=True)" in message
    assert ("state_models.py:" if update == "+=" else "test_runtime.py:") in message


def test_a_splitting_op_counts_each_call_once_by_skipping_rehearsals():
    """The first call runs the model several times (warm-up, then per capture size on CUDA); a splitting op
    that skips its update while context().rehearsal is True counts every call exactly once."""
    from fixtures.state_models import CallCounter

    model = CallCounter()
    counter, expected = torch.zeros(()), torch.zeros(())
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad():
        for calls, tokens in enumerate((3, 5, 1, 12), start=1):  # 12 > max_tokens runs unpadded
            x = torch.randn(tokens, 8)
            torch.testing.assert_close(runner(x, counter), model(x, expected))
            assert float(counter) == float(expected) == calls


def test_a_trace_that_assumes_more_than_one_token_pads_one_token_calls_to_two():
    """`cache[positions] = values` traces with a broadcasting check that holds for every size but 1: one-token
    calls run padded to the next size. With 1 the only size, it is refused, naming the line with its full path
    and the alternative."""
    import os

    from fixtures import state_models

    model = state_models.SetItemWriter()
    cache, expected = torch.zeros(16, 8), torch.zeros(16, 8)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo"))
    with torch.no_grad():
        for tokens, start in ((3, 0), (1, 3), (1, 4), (6, 5)):
            x, positions = torch.randn(tokens, 8), torch.arange(start, start + tokens)
            torch.testing.assert_close(runner(x, positions, cache), model(x, positions, expected))
            torch.testing.assert_close(cache, expected)
    assert runner.stats["capture_sizes"][0] == 2 and runner.stats["eager_writes"] == 1

    runner = piecewise.compile(state_models.SetItemWriter(),
                               piecewise.CaptureConfig(capture_sizes=[1], max_tokens=1, frontend="dynamo"))
    with torch.no_grad(), pytest.raises(ValueError) as failure:
        runner(torch.randn(3, 8), torch.arange(3), torch.zeros(16, 8))  # above max_tokens: through the same trace
    message = str(failure.value)
    assert "depends on the token count" in message and "cache[positions] = self.proj(x)" in message
    assert f"{os.path.abspath(state_models.__file__)}:" in message  # torch's location cuts the path short
    assert "x.index_copy_(0, index, values)" in message
    # auto takes breakable then, which runs the write at every size as it is written
    model = state_models.SetItemWriter()
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1], max_tokens=1))
    cache, expected = torch.zeros(16, 8), torch.zeros(16, 8)
    with torch.no_grad(), pytest.warns(UserWarning, match="runs with the breakable front-end"):
        for tokens, start in ((3, 0), (1, 3), (2, 4)):
            x, positions = torch.randn(tokens, 8), torch.arange(start, start + tokens)
            torch.testing.assert_close(runner(x, positions, cache), model(x, positions, expected))
            torch.testing.assert_close(cache, expected)
    assert runner.stats["frontend"] == "breakable"


@pytest.mark.parametrize("how, line", [("sum", "return h + h.sum(0)"), ("softmax", "return h.softmax(0)"),
                                       ("argmax", "return h.argmax(0)"), ("last", "return h[-1]")])
def test_a_forward_that_mixes_token_rows_is_refused_with_the_line(how, line):
    """Padding rows would change the real rows' results on every padded call: the first call runs its leading
    tokens padded twice (zero padding, then copies of real rows) and refuses a forward whose results differ,
    naming the candidate lines."""
    from fixtures import state_models

    runner = piecewise.compile(state_models.TokenMixing(how), piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad():
        for _ in range(2):  # a second call checks again instead of running unchecked
            with pytest.raises(ValueError) as failure:
                runner(torch.randn(5, 8))
            message = str(failure.value)
            assert "the forward mixes tokens: with 1 real token(s) padded to 2" in message
            assert "state_models.py:" in message and f"(`{line}`)" in message
            assert "piecewise.opaque_op(..., split=True)" in message


def test_token_mixing_inside_a_splitting_op_passes_the_check_and_equals_eager():
    from fixtures.state_models import SplitTokenMixing

    model = SplitTokenMixing()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad():
        for tokens in (5, 3, 1, 8, 11):
            x = torch.randn(tokens, 8)
            torch.testing.assert_close(runner(x), model(x))


def test_sampling_with_torch_rng_in_forward_passes_the_padding_check_and_matches_eager():
    """Per-token sampling in forward (torch.rand, inverse CDF) does not trip the padding check (both of its
    runs draw the same numbers), and with the same seed a padded call samples what eager samples (CPU: the
    padded draw starts with the real rows' numbers)."""

    class Sampler(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 32)

        def forward(self, x):
            probs = self.linear(x).softmax(-1)
            u = torch.rand(probs.shape[0], 1, device=x.device)
            return torch.searchsorted(probs.cumsum(-1), u).clamp_max(31)

    model = Sampler()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad():
        runner(torch.randn(5, 8))
        for seed, tokens in enumerate((3, 5, 1, 7)):
            x = torch.randn(tokens, 8)
            torch.manual_seed(seed)
            out = runner(x)
            torch.manual_seed(seed)
            torch.testing.assert_close(out, model(x))


def test_replacing_a_parameter_buffer_or_submodule_after_the_first_call_is_refused():
    """The graphs read parameters and buffers by address: a new object assigned after the first call would be
    ignored silently. In-place updates (copy_, load_state_dict) keep working; a forward assigning its own
    attributes is not flagged."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(4, 4)
            self.second = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x):
            return self.second(self.first(x).relu()) * self.scale

    x = torch.randn(3, 4)
    replacements = {
        "parameter `first.weight`": lambda m: setattr(m.first, "weight", torch.nn.Parameter(torch.randn(4, 4))),
        "buffer `scale`": lambda m: setattr(m, "scale", torch.full((4,), 2.0)),
        "submodule `second`": lambda m: setattr(m, "second", torch.nn.Linear(4, 4)),
        # assign=True assigns every entry anew; the first one assigned is reported
        "": lambda m: m.load_state_dict({**m.state_dict(), "first.bias": torch.randn(4)}, assign=True),
        "parameter(s) or buffer(s) changed (`first.weight` first: `.data = ...`, model.to()": lambda m: m.to(torch.float64),
    }
    for what, replace in replacements.items():
        model = Net()
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
        with torch.no_grad():
            runner(x)
            model.first.weight.copy_(torch.randn(4, 4))  # in place: seen by the graphs
            model.load_state_dict({**model.state_dict(), "scale": torch.full((4,), 3.0)})
            torch.testing.assert_close(runner(x), model(x))
            replace(model)
            with pytest.raises(ValueError, match=f"{re.escape(what)}.* after the first call.*copy_"):
                runner(x)


_IMPORT_EACH_FIRST = r"""
import os, sys, traceback
import torch
for library in ("transformers", "triton", "rich", "numpy", "matplotlib.pyplot"):  # not piecewise's: loaded once
    try:
        __import__(library)
    except ImportError:
        pass
root = os.path.join(sys.argv[1], "piecewise")
names = sorted("piecewise." + os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")
               for d, _, files in os.walk(root) for f in files if f.endswith(".py"))
names = [n.removesuffix(".__init__") for n in names if n != "piecewise.__init__"]
# What piecewise's modules import from outside it (torch._dynamo, ...), loaded once here rather than in every
# child: a first child imports all of piecewise and names them.
read, write = os.pipe()
if os.fork() == 0:
    for name in names:
        try:
            __import__(name)
        except BaseException:
            pass
    os.write(write, "\n".join(m for m in list(sys.modules) if m.split(".")[0] != "piecewise").encode())
    os._exit(0)
os.close(write)
with os.fdopen(read) as pipe:
    outside = pipe.read().split()
os.wait()
for name in outside:
    try:
        __import__(name)
    except BaseException:
        pass
running, failed = {}, []


def reap():
    pid, status = os.wait()
    if status:
        failed.append(running[pid])
    del running[pid]


for name in names:
    if len(running) >= os.cpu_count():
        reap()
    pid = os.fork()
    if pid == 0:  # a fresh interpreter but for torch: this module is the first of piecewise's imported
        try:
            __import__(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    running[pid] = name
while running:
    reap()
print("failed:", sorted(failed))
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_every_module_imports_when_it_is_the_first_of_the_package_imported():
    """``from piecewise.frontends.dynamo import ...`` in a fresh process must not hit an import cycle."""
    import os
    import subprocess
    import sys

    src = os.path.dirname(os.path.dirname(piecewise.__file__))
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH_FIRST, src], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": src})
    assert done.returncode == 0, done.stderr
    assert "failed: []" in done.stdout, done.stdout + done.stderr[-3000:]


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_kv_cache_too_short_for_the_positions_is_named_with_max_seq_len(frontend):
    from piecewise.models.decode import DecodeLlama
    from piecewise.models.llama import LlamaConfig

    model, (ids, positions, _) = example(tokens=4, num_layers=1)
    cache = model.make_kv_cache(max_seq_len=8)
    assert cache.shape[2] == 8
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    runner(ids, positions, cache)
    with pytest.raises(ValueError, match=re.escape(
            "position 9 is past the KV cache, whose max_seq_len is 8 (positions 0 to 7): make a longer cache, "
            "make_kv_cache(max_seq_len=10) or more")):
        runner(ids, positions + 6, cache)  # a later call, replayed (pieces padded on the CPU)
    decode = DecodeLlama(LlamaConfig(vocab_size=64, hidden_size=32, num_layers=1, head_dim=8, intermediate_size=64))
    with pytest.raises(ValueError, match=r"position 1024 is past the KV cache, whose max_seq_len is 16 "):
        decode(torch.tensor([1, 2]), torch.tensor([3, 1024]), decode.make_kv_cache(2, max_seq_len=16))


def test_ids_taken_batch_first_that_were_not_say_how_to_name_the_token_dimension():
    """Codes [T, 4] first called with one token look like ids [1, 4] (batch-first): a later call of 5 tokens
    runs the model's own forward, and the warning names the dimension taken and the dynamic= to pass."""
    model = torch.nn.Embedding(16, 8)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=None))
    codes = torch.randint(0, 16, (5, 4))
    with torch.no_grad():
        runner(codes[:1])
        with pytest.warns(UserWarning, match=r"argument 'input' has shape \(5, 4\) and had \(1, 4\) at the first "
                                             r"call \(dimension 0\); its token dimension is 1, .*if dimension 0 "
                                             r"carries the tokens, pass dynamic=\{'input': 0, ...\}"):
            torch.testing.assert_close(runner(codes), model(codes))
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=None), dynamic={"input": 0})
    with torch.no_grad():
        runner(codes[:1])
        torch.testing.assert_close(runner(codes), model(codes))
    assert runner.stats["eager_calls"] == 0


class Codebooks(torch.nn.Module):
    """Codes [tokens, books] (several codebooks per token), summed per token."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)

    def forward(self, codes):
        return self.embed(codes).sum(1)


def test_a_refusal_after_ids_taken_batch_first_says_how_to_name_dimension_0():
    """Codes [1, 3] at the first call look like one sequence of 3 ids: the sum over them mixes tokens, refused; the
    refusal says what piecewise took and the dynamic= for dimension 0, which then serves the calls."""
    from piecewise.errors import ForwardRefused

    model = Codebooks()
    codes = torch.randint(0, 16, (5, 3))
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused) as info:
        runner(codes[:1])
    assert "piecewise took 'codes' (1, 3) as one sequence, the tokens in dimension 1" in str(info.value)
    assert "pass dynamic={'codes': 0}" in str(info.value)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=None), dynamic={"codes": 0})
    with torch.no_grad():
        for rows in (1, 5, 2):
            torch.testing.assert_close(runner(codes[:rows]), model(codes[:rows]))


def test_a_torch_compiled_module_is_compiled_from_its_original_with_a_warning():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    with pytest.warns(UserWarning, match=r"got a torch.compile'd module: .*model._orig_mod") as caught:
        runner = piecewise.compile(torch.compile(model), piecewise.CaptureConfig(max_tokens=8, cache_dir=None))
    assert [w.filename for w in caught if "torch.compile'd" in str(w.message)] == [__file__]
    with torch.no_grad():
        for tokens in (3, 5):
            x = torch.randn(tokens, 8)
            torch.testing.assert_close(runner(x), model(x))
    assert runner.model is model


class NamedAndKeywords(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x, scale=None, **options):
        return self.a(x) * (2 if options.get("double") else 1)


def test_a_forward_with_keyword_arguments_is_called_without_dynamos_frame_hook():
    """``forward(x, scale=None, **options)``: the compiled code's guard sees the named parameters as locals and the
    rest as the keywords dict, so calls skip Dynamo's frame hook; another keyword value is another variant."""
    model = NamedAndKeywords().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo", cache_dir=None))
    with torch.no_grad():
        for tokens in (3, 5, 2):
            x = torch.randn(tokens, 4)
            torch.testing.assert_close(runner(x), model(x))
        assert runner.frontend.tracer.last_direct
        with pytest.warns(UserWarning, match="argument 'double' is given now"):
            torch.testing.assert_close(runner(x, double=True), model(x, double=True))
