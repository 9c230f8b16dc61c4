"""The shape guards a trace recorded, evaluated at every token count (``graph.guards.token_guard_failures``): the
conditions are printed to Python once and evaluated per count; each answer equals sympy's own substitution."""

import pytest
import torch

from piecewise.graph import guards
from piecewise.graph.tokens import placeholder_values


def traced_inputs(fn, tokens: int) -> list:
    """The inputs of Dynamo's graph of ``fn``, traced with dimension 0 of its input dynamic: fakes whose mode holds
    the shape environment and its guards."""
    seen = []

    def backend(graph, example_inputs):
        seen.append(placeholder_values(graph))  # the fakes, with their symbolic sizes
        return graph.forward

    x = torch.randn(tokens, 8)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=None)(x)
    return seen[-1]


def branches(x):
    n = x.shape[0]
    if n % 4 == 0:  # Eq(Mod(s, 4), 0)
        x = x * 2
    if n // 3 > 2:  # FloorDiv
        x = x + 1
    if min(n, 20) > 10:
        x = x - 1
    return x.reshape(-1, 2, 4).sum(1) if n > 16 else x


def by_sympy(example_inputs, sizes):
    """The reference: every guard with the token symbol substituted through sympy."""
    shape_env = guards.fake_mode_of(example_inputs).shape_env
    token = next(v.shape[0].node.expr for v in example_inputs if isinstance(v, torch.Tensor))
    failures = []
    for guard in shape_env.guards:
        if token not in guard.expr.free_symbols:
            continue
        failures += [(str(guard.expr), size) for size in sizes if not bool(guard.expr.subs({token: size}))]
    return failures


@pytest.mark.parametrize("tokens", [8, 12, 24, 40])
def test_printed_guards_answer_as_sympy_does(tokens):
    example_inputs = traced_inputs(branches, tokens)
    sizes = list(range(1, 80))
    found = [(condition, size) for condition, _, size in guards.token_guard_failures(example_inputs, sizes)]
    assert found == by_sympy(example_inputs, sizes)
    assert found  # the branches hold at the traced count and fail at others


def test_a_guard_the_printer_cannot_print_is_evaluated_by_sympy(monkeypatch):
    example_inputs = traced_inputs(branches, 12)
    sizes = list(range(1, 40))
    expected = by_sympy(example_inputs, sizes)

    class Broken:
        def doprint(self, expr):
            raise NotImplementedError("no printer for this function")

    monkeypatch.setattr("torch.utils._sympy.printers.PythonPrinter", Broken)
    assert [(c, s) for c, _, s in guards.token_guard_failures(example_inputs, sizes)] == expected
