"""Pieces that compute the same function of their inputs (a model's layers) are compiled once and share the
compiled callable; pieces that differ in an op, a constant or an input's shape are compiled apart. The compiler
here is a stand-in for Inductor that runs the piece's own graph, so a piece wrongly given another's code would
compute the other's function, and the outputs would differ from eager."""

import pytest
import torch

import piecewise
from piecewise.capture import compilers
from piecewise.models import example


@pytest.fixture
def compiled(monkeypatch):
    """The graphs handed to the (stand-in) Inductor compiler, in order. Dynamo's memory of which dimensions turned
    dynamic (kept per function name and line for the process) is reset: each test compiles as a process's first."""
    torch._dynamo.reset()
    graphs = []

    def compile(self, graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    monkeypatch.setattr(compilers.InductorCompiler, "compile", compile)
    return graphs


def run(model, ids, positions, cache, frontend):
    with torch.no_grad():
        expected = model(ids, positions, cache.clone())
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend,
                                                                   compiler="inductor"))
        out = runner(ids, positions, cache)
        torch.testing.assert_close(out, expected)  # padding changes matmul blocking: not bitwise
        later = model(ids[:3], positions[:3] + 5, cache.clone())
        torch.testing.assert_close(runner(ids[:3], positions[:3] + 5, cache), later)
    return runner


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_the_layers_of_a_model_are_compiled_once(compiled, frontend):
    torch.manual_seed(0)
    model, (ids, positions, cache) = example(tokens=5, num_layers=4)
    runner = run(model, ids, positions, cache, frontend)
    # 4 layers between 4 attention calls: 5 pieces, of which the 3 between two attention calls are alike. Each
    # front-end traces the forward once, with the token count dynamic from the first trace (breakable's unpadded
    # rehearsals too: a second trace would compile every piece again)
    assert len(compiled) == 3
    assert runner.stats.pieces_shared == 2


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("made_under", ["grad", "no_grad", "inference_mode"])
def test_inference_tensors_and_slices_trace_once(compiled, frontend, made_under):
    """Token arguments made with grad on, under ``no_grad`` or under ``inference_mode()``, sliced from longer
    tensors as a serving loop passes them: still one trace (a view or another dispatch key than the staged
    buffers' would be traced again)."""
    torch.manual_seed(0)
    model, (ids, positions, cache) = example(tokens=7, num_layers=4)
    mode = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[made_under]
    with mode():
        ids, positions = ids.clone()[:5], positions.clone()[:5]
    with torch.inference_mode():
        expected = model(ids, positions, cache.clone())
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend,
                                                                   compiler="inductor"))
        torch.testing.assert_close(runner(ids, positions, cache), expected)
        later = model(ids[:2], positions[:2] + 5, cache.clone())
        torch.testing.assert_close(runner(ids[:2], positions[:2] + 5, cache), later)
    assert len(compiled) == 3


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("change", ["constant", "op", "shape"])
def test_a_layer_that_differs_is_compiled_apart(compiled, frontend, change):
    torch.manual_seed(0)
    model, (ids, positions, cache) = example(tokens=5, num_layers=4)
    layer = model.layers[2]
    if change == "constant":  # in piece 2 (layer 1's MLP, layer 2's norm)
        layer.input_norm.eps = 1.0  # a Python float the trace bakes in
    elif change == "op":  # in piece 3 (layer 2's MLP, layer 3's norm)
        layer.post_norm.forward = lambda x, norm=layer.post_norm: norm.weight * torch.tanh(x)
    else:  # in piece 3
        hidden = model.config.hidden_size
        layer.gate_up = torch.nn.Linear(hidden, 4 * model.config.intermediate_size, bias=False)
        layer.down = torch.nn.Linear(2 * model.config.intermediate_size, hidden, bias=False)
    runner = run(model, ids, positions, cache, frontend)
    # of the three pieces between attention calls, the two unchanged ones share
    assert len(compiled) == 4
    assert runner.stats.pieces_shared == 1


def test_no_sharing_when_inductor_freezes_the_parameters(compiled):
    """Frozen parameters become constants of the compiled code: a layer's code would carry its own weights."""
    from torch._inductor import config

    torch.manual_seed(0)
    model, (ids, positions, cache) = example(tokens=5, num_layers=4)
    with config.patch(freezing=True):  # (monkeypatch's undo deletes a config option: later compiles would fail)
        runner = run(model, ids, positions, cache, "dynamo")
    assert len(compiled) == 5 and runner.stats.pieces_shared == 0


def test_the_key_tells_apart_constants_that_compare_equal():
    """-0.0 == 0.0 and True == 1 in Python; as constants of a piece they are different functions."""
    def traced(constant):
        graph = torch.fx.symbolic_trace(lambda x: torch.add(x, constant))
        for node in graph.graph.nodes:
            if node.op == "placeholder":
                node.meta["example_value"] = torch.empty(3)
        return compilers.piece_key(graph)

    assert traced(0.0) != traced(-0.0)
    assert traced(1) != traced(True)
    assert traced(2.0) == traced(2.0)
