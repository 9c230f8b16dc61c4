import pytest
import torch

import piecewise
from piecewise.opaque import opaque_op_info, splitting_op_names


@piecewise.opaque_op("test_opaque::scale_add")
def scale_add(x: torch.Tensor, y: torch.Tensor, alpha: float, flag: bool, tag: str, maybe: torch.Tensor | None, n: int) -> torch.Tensor:
    out = x * alpha + y * n
    if flag and maybe is not None:
        out = out + maybe
    return out + len(tag)


def _pair_fake(x):
    return torch.empty_like(x), x.new_empty(x.shape[0])


@piecewise.opaque_op("test_opaque::pair", fake=_pair_fake)
def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, x.sum(-1)


@piecewise.opaque_op("test_opaque::fill", mutates_args=("out",))
def fill(out: torch.Tensor, value: float) -> None:
    out.fill_(value)


def test_opaque_ops_trace_as_one_node_and_run_the_body_only_eagerly():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(x, y, buffer):
        a = scale_add(x, y, 2.0, True, "ab", y, 3)
        b, s = pair(a)
        fill(buffer, 7.0)
        return b, s

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    calls_before = opaque_op_info("test_opaque::scale_add").eager_calls
    buffer = torch.zeros(2)
    out, total = torch.compile(fn, backend=backend, fullgraph=True)(x, y, buffer)
    expected = x * 2.0 + y * 3 + y + 2
    torch.testing.assert_close(out, expected + 1)
    torch.testing.assert_close(total, expected.sum(-1))
    assert buffer.tolist() == [7.0, 7.0]
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("scale_add" in t for t in targets) and any("fill" in t for t in targets)
    assert opaque_op_info("test_opaque::scale_add").eager_calls == calls_before + 1  # the real call only


def test_tuple_return_needs_a_fake():
    with pytest.raises(ValueError, match="fake="):

        @piecewise.opaque_op("test_opaque::pair_without_fake")
        def pair_without_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x


def test_split_flag_registers_a_splitting_op():
    @piecewise.opaque_op("test_opaque::splitter", split=True)
    def splitter(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    assert "test_opaque::splitter" in splitting_op_names()


def test_duplicate_name_is_a_clear_error():
    with pytest.raises(ValueError, match="already exists"):

        @piecewise.opaque_op("test_opaque::pair", fake=_pair_fake)
        def again(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x


def test_bad_name_is_rejected():
    with pytest.raises(ValueError, match="namespace::name"):
        piecewise.opaque_op("bad name::x")


def library_quantize(x, global_scale, swizzle=False, block=16):
    """An unannotated library function, like most JIT kernel entry points."""
    scaled = x * global_scale
    return scaled.round(), scaled.abs().amax(-1) / block + (1.0 if swizzle else 0.0)


def test_wrap_opaque_infers_the_schema_from_the_first_call_and_keeps_keywords():
    fake = lambda x, global_scale, swizzle=False, block=16: (torch.empty_like(x), x.new_empty(x.shape[0]))  # noqa: E731
    wrapped = piecewise.wrap_opaque(library_quantize, fake=fake)
    assert piecewise.wrap_opaque(library_quantize, fake=fake) is wrapped
    x = torch.randn(4, 32)
    scale = torch.tensor(3.0)
    eager = wrapped(x, scale, swizzle=True)  # defines the op
    torch.testing.assert_close(eager[1], library_quantize(x, scale, swizzle=True)[1])
    compiled = torch.compile(lambda t: wrapped(t, scale, block=8, swizzle=True), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x)[1], library_quantize(x, scale, True, 8)[1])


def test_wrap_opaque_explicit_schema_must_name_the_functions_parameters():
    with pytest.raises(ValueError, match=r"takes \['a', 'b'\]"):
        piecewise.wrap_opaque(lambda a, b: a + b, name="test_opaque::add_bad", schema="(Tensor x, Tensor y) -> Tensor")
    add = piecewise.wrap_opaque(lambda a, b: a + b, name="test_opaque::add_ok", schema="(Tensor a, Tensor b) -> Tensor")
    torch.testing.assert_close(add(torch.ones(2), b=torch.ones(2)), torch.full((2,), 2.0))


def test_wrap_opaque_rejects_arguments_it_cannot_type():
    wrapped = piecewise.wrap_opaque(lambda x, opts: x * 2, name="test_opaque::takes_dict")
    with pytest.raises(ValueError, match="argument 'opts' is a dict"):
        wrapped(torch.ones(2), {"a": 1})


def test_mutates_args_takes_one_name_and_names_a_missing_parameter():
    @piecewise.opaque_op("test_opaque::bump_one", mutates_args="state")
    def bump_one(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        state.add_(1)
        return x + 1

    state = torch.zeros(2)
    bump_one(torch.zeros(2), state)
    assert state.tolist() == [1.0, 1.0]
    written = [a.name for a in bump_one._opoverload._schema.arguments if a.alias_info and a.alias_info.is_write]
    assert written == ["state"]
    with pytest.raises(ValueError, match=r"mutates_args names \['cache'\], which bump_two has no parameter for; "
                                         r"its parameters: \['x', 'state'\]"):
        @piecewise.opaque_op("test_opaque::bump_two", mutates_args="cache")
        def bump_two(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
            return x + 1


@piecewise.opaque_op("test_opaque::mixed_linear", fake=lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
def mixed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)  # bfloat16 x, float32 w: only autocast makes these agree


def test_a_users_op_keeps_the_callers_autocast_and_piecewises_own_attention_computes_in_its_inputs_dtype():
    """A user's op body may rely on autocast (mixed dtypes): it keeps it. piecewise's own attention ops run with
    autocast off, so that their outputs' dtypes are what their fakes say."""
    from piecewise.models.attention import attention

    x, w = torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(5, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mixed_linear(x, w).dtype == torch.bfloat16
        q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
        cache = torch.zeros(1, 2, 8, 1, 8)
        assert attention(q, k, k, torch.arange(3), cache, 0).dtype == torch.float32


def test_ops_of_a_module_with_postponed_annotations_register_and_run_in_a_runner():
    # ``from __future__ import annotations``: the types are strings naming the module's own imports (Tensor,
    # Optional); torch.library takes them, so piecewise's ops must too (they were evaluated in piecewise's module).
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from fixtures import future_annotations as f

    attend = piecewise.opaque_op("test_opaque::future_add_maybe", split=True)(f.add_maybe)
    scaled = piecewise.wrap_opaque(f.scale, name="test_opaque::future_scale")
    x = torch.randn(5, 8)
    torch.testing.assert_close(attend(x, None), f.add_maybe(x, None))
    torch.testing.assert_close(scaled(x, factor=3.0), x * 3)
    torch.manual_seed(0)
    model = f.Model(attend, scaled).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad():
        for tokens in (5, 3, 8):
            x = torch.randn(tokens, 8)
            torch.testing.assert_close(runner(x), model(x))
