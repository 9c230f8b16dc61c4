"""What the Dynamo front-end (and the runtime around both front-ends) promises a user: explicit capture sizes,
splitting-op names, grad and inference modes, what the CLI prints."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import piecewise
from piecewise.models import example

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
TARGETS = os.path.join(HERE, "fixtures", "doctor_targets.py")
FRONTENDS = ["dynamo", "breakable"]


def sequence(model, runner, counts, cache):
    reference = cache.clone()
    for tokens in counts:
        ids, positions = torch.randint(0, model.config.vocab_size, (tokens,)), torch.arange(tokens)
        out = runner(ids, positions, cache)
        with torch.no_grad():
            expected = model(ids, positions, reference)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(cache, reference)
    return out


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_explicit_capture_sizes_top_the_graphs_and_larger_calls_run_without_them(frontend):
    model, (_, _, cache) = example(tokens=3)
    config = piecewise.CaptureConfig(capture_sizes=[1, 2, 4, 15], frontend=frontend, graph_mode="piecewise")
    assert config.max_tokens == 15
    runner = piecewise.compile(model, config)
    with torch.no_grad():
        sequence(model, runner, (3, 15, 16, 40, 5), cache)
    runner.stats.expect(fallback_calls=2, padded_calls=3, capture_sizes=[1, 2, 4, 15])
    with pytest.raises(ValueError, match=r"capture_sizes tops at 4 but max_tokens=8.*Leave max_tokens out"):
        piecewise.CaptureConfig(capture_sizes=[1, 2, 4], max_tokens=8)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_splitting_op_named_by_its_overload_splits_and_an_unknown_name_is_refused(frontend):
    model, (ids, positions, cache) = example(tokens=5)
    config = piecewise.CaptureConfig(max_tokens=8, splitting_ops=("piecewise_examples::attention.default",),
                                     frontend=frontend)
    runner = piecewise.compile(model, config)
    with torch.no_grad():
        sequence(model, runner, (5, 2), cache)
    assert runner.stats["pieces"] == model.config.num_layers + 1 and runner.stats["eager_writes"] == 0
    with pytest.raises(ValueError, match=r"'nosuch::op', which is not a registered op.*piecewise_examples::attention"):
        piecewise.compile(model, piecewise.CaptureConfig(splitting_ops=("nosuch::op",), frontend=frontend))
    with pytest.raises(ValueError, match=r"attention.nosuch', which is not a registered op overload.*\['default'\]"):
        piecewise.compile(model, piecewise.CaptureConfig(splitting_ops=("piecewise_examples::attention.nosuch",)))


def test_a_config_given_as_a_dict_is_a_type_error_naming_capture_config():
    model, _ = example()
    with pytest.raises(TypeError, match=r"config must be a piecewise.CaptureConfig, got dict.*CaptureConfig\(\*\*"):
        piecewise.compile(model, {"max_tokens": 8})


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_first_call_with_autograd_on_runs_with_inference_semantics(compiler):
    model, (ids, positions, cache) = example(tokens=5, num_layers=1)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, compiler=compiler, frontend="dynamo"))
    assert torch.is_grad_enabled()
    out = sequence(model, runner, (5, 3, 9), cache)
    assert not out.requires_grad and out.grad_fn is None
    out.add_(1)  # an ordinary tensor the caller owns


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_first_call_inside_inference_mode_then_calls_outside_it_run_on_one_trace(frontend):
    model, (ids, positions, cache) = example(tokens=5)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.inference_mode():
        runner(ids, positions, cache)
    with torch.no_grad():
        sequence(model, runner, (5, 2, 12), cache)
    assert runner.stats["traces"] == (1 if frontend == "dynamo" else 0)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_inputs_made_outside_inference_mode_called_inside_it_above_the_graphs_need_no_second_trace(frontend):
    model, (ids, positions, cache) = example(tokens=5)
    big = (torch.randint(0, model.config.vocab_size, (12,)), torch.arange(12))  # made outside inference mode
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "traced again" warning
        runner(ids, positions, cache)
        runner(*big, cache)
    assert runner.stats["traces"] == (1 if frontend == "dynamo" else 0) and runner.stats["fallback_calls"] == 1


def test_one_token_calls_padded_to_two_are_reported_with_the_reason():
    from fixtures import state_models

    runner = piecewise.compile(state_models.SetItemWriter(), piecewise.CaptureConfig(max_tokens=8, frontend="dynamo"))
    with torch.no_grad():
        runner(torch.randn(3, 8), torch.arange(3), torch.zeros(16, 8))
    assert runner.stats["capture_sizes"][0] == 2
    assert runner.stats["size_notes"] and runner.stats["size_notes"][0].startswith("calls of 1 token are padded to 2")
    assert "the trace assumes more than one token" in runner.stats["size_notes"][0]


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "piecewise.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": SRC, "COLUMNS": "80"}, timeout=600)


def test_run_on_a_model_dynamo_cannot_take_prints_the_blockers_and_exits_1_without_a_traceback():
    done = cli("run", f"{TARGETS}:jit_model", "--strict")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "jit_subprocess" in done.stderr and "wrap_opaque" in done.stderr


def test_doctor_keeps_torch_noise_off_the_terminal_and_piped_paths_whole():
    done = cli("doctor", f"{TARGETS}:jit_model")
    assert done.returncode == 1
    assert len(done.stderr.splitlines()) <= 2, done.stderr  # no guard errors, FX tracebacks or Dynamo warnings
    path = os.path.realpath(os.path.join(HERE, "fixtures", "blocker_models.py"))
    assert any(f"{path}:" in line for line in done.stdout.splitlines()), "a file path split over two lines"


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
@pytest.mark.parametrize("attention", ["writes_cache", "reads_cache", "no_cache"])
@pytest.mark.parametrize("jit_at", ["norm", "before_attention", "after_residual", "mlp"])
def test_dynamo_graph_breaks_inside_layers_with_splitting_ops_equal_eager(jit_at, attention, mode):
    """frontend="dynamo": each JIT-style call becomes an eager region between captured pieces, wherever it sits in
    a layer around an attention op that writes, reads or keeps no cache; outputs and caches equal eager at every
    size 1..max+1 (the pieces after a break get their token rows by shape, and Dynamo keeps their shape guards)."""
    sys.path.insert(0, os.path.join(HERE, "fixtures"))
    import break_models as bm
    from test_breakable import run_sequence

    model = bm.make(jit_at, attention)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_sequence(model, runner, mode, offset=3)
    ours = [str(w.message) for w in caught if "piecewise" in str(w.message)]
    assert len(ours) == 1 and "runs eagerly between captured pieces" in ours[0] and "jit_subprocess" in ours[0]
    assert runner.stats["graph_breaks"] == 1 and runner.stats["frontend"] == "dynamo"



def record_every_call(model, kind: str) -> None:
    """Python state a forward changes on every call, the two usual ways: a list a hook appends to, a counter."""
    if kind == "list":
        seen = []
        model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    else:
        def count(module, args):
            module.piecewise_test_calls = getattr(module, "piecewise_test_calls", 0) + 1
        model.layers[0].register_forward_pre_hook(count)


@pytest.mark.parametrize("kind", ["list", "counter"])
def test_python_state_the_forward_changes_every_call_moves_auto_to_breakable_and_dynamo_names_it(kind):
    """Dynamo guards on that state, so it would trace again on every call and fail hard after eight. ``auto``
    takes the breakable front-end with the guard in its warning; ``dynamo`` refuses naming it and the model line;
    both equal eager."""
    from piecewise.errors import ForwardRefused

    model, (_, _, cache) = example(tokens=3, num_layers=2)
    record_every_call(model, kind)
    with pytest.warns(UserWarning, match=r"(?s)cannot take this forward.*\[state_guard\].*guard that failed"):
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
        sequence(model, runner, [3, 1, 1, 5, 2, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], cache.clone())
    assert runner.stats["frontend"] == "breakable"
    strict = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo"))
    with pytest.raises(ForwardRefused, match=r"Python state changes from call to call.*frontend='breakable'") as refused:
        with torch.no_grad():
            ids = torch.randint(0, model.config.vocab_size, (3,))
            strict(ids, torch.arange(3), cache.clone())
    assert refused.value.kind == "state_guard"
    frame, = refused.value.chain
    assert (frame.filename, frame.name) == (__file__, "<lambda>" if kind == "list" else "count")

