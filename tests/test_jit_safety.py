"""The FlashInfer-style JIT scenario inside piecewise.compile: default, strict, and fixed with wrap_opaque."""

import os
import sys
import warnings

import pytest
import torch

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
if FIXTURES not in sys.path:
    sys.path.insert(0, FIXTURES)

import blocker_models as bm  # noqa: E402
import fakejit  # noqa: E402
import fakejit.quant  # noqa: E402

import piecewise  # noqa: E402


def test_dynamo_runs_the_untraceable_region_eagerly_with_one_warning():
    model = bm.JitModel()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [(runner(x), x) for x in (bm.example_input(3), bm.example_input(5), bm.example_input(8))]
    ours = [w for w in caught if "piecewise" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert "jit_subprocess" in message and "wrap_opaque" in message and "fp4_quantize" in message
    assert "get_cuda_version" in message
    with torch.no_grad():
        for out, x in outputs:
            torch.testing.assert_close(out, model(x))
    assert runner.stats["graph_breaks"] == 1


def test_strict_raises_with_the_chain_down_to_the_subprocess_call():
    runner = piecewise.compile(bm.JitModel(), piecewise.CaptureConfig(max_tokens=8, strict=True))
    with pytest.raises(piecewise.CaptureBlockedError) as info:
        runner(bm.example_input(3))
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert [b.kind for b in info.value.blockers] == ["jit_subprocess"]
    functions = [frame.function for frame in info.value.blockers[0].chain]
    assert functions[0] == "forward" and functions[-1] == "get_cuda_version"
    assert "fp4_quantize" in functions and "is_cuda_version_at_least" in functions
    assert "env.py" in message and "in get_cuda_version" in message
    assert "piecewise.wrap_opaque(fakejit.fp4_quantize" in message


def test_wrap_opaque_makes_it_capture_safe_and_the_check_never_runs_while_tracing(monkeypatch):
    compiling_during_checks = []
    original = fakejit.quant.is_cuda_version_at_least

    def watched(version):
        compiling_during_checks.append(torch.compiler.is_compiling())
        return original(version)

    monkeypatch.setattr(fakejit.quant, "is_cuda_version_at_least", watched)
    fakejit.quant.get_fp4_module.cache_clear()
    model = bm.WrappedJitModel()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        for tokens in (8, 1, 5, 11):
            x = bm.example_input(tokens)
            out = runner(x)
            with torch.no_grad():
                torch.testing.assert_close(out, model(x))
    assert runner.stats["traces"] == 1 and runner.stats["graph_breaks"] == 0
    assert compiling_during_checks == [False], "the version check ran once, eagerly, never under tracing"
