"""An opaque op's strides against its fake's: compiled pieces (Inductor) assert the strides they were traced with.
The common slip, an attention computed head-major and returned transposed while its fake is contiguous (as every
transformers model whose rotary embedding concatenates makes it: GLM, partial-rotary models), runs correctly in
every mode; a fake of other strides than the op's is refused by name where Inductor compiles."""

from __future__ import annotations

import pytest
import torch

import piecewise
from piecewise.errors import FakeMismatch
from piecewise.opaque import check_fakes


@piecewise.opaque_op("fake_strides::head_major_attention", split=True,
                     fake=lambda q, k, v: q.new_empty(q.shape))
def head_major_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q / k / v token-major [T, H, D]; attends head-major and returns the transposed result (not contiguous)."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=True)
    return out.transpose(0, 1)


class Block(torch.nn.Module):
    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        # head-major first, token-major after (a concatenating rotary embedding leaves q / k so)
        q, k, v = self.qkv(x).view(tokens, 3, self.heads, -1).permute(1, 2, 0, 3).contiguous().transpose(1, 2)
        attended = head_major_attention(q, k, v)
        return self.out(attended.reshape(tokens, -1) * 2 + x)


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_an_op_returning_a_transposed_result_runs_in_compiled_pieces(frontend):
    torch.manual_seed(0)
    model = Block().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, compiler="inductor"))
    with torch.no_grad():
        for tokens in (8, 5, 1, 9):
            x = torch.randn(tokens, 32)
            torch.testing.assert_close(runner(x), model(x), atol=1e-5, rtol=1e-5)


def _transposed_fake(x):
    return x.new_empty(x.shape[::-1]).t()


@piecewise.opaque_op("fake_strides::contiguous_double", fake=_transposed_fake)
def contiguous_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2  # contiguous, where the fake promises column-major


def test_a_fake_of_other_strides_than_the_op_is_named_with_both_where_inductor_compiles():
    contiguous_double(torch.ones(3, 4))
    check_fakes(["fake_strides::contiguous_double"])  # eager pieces run it as it is
    with pytest.raises(FakeMismatch) as caught:
        check_fakes(["fake_strides::contiguous_double"], strides=True)
    assert str(caught.value) == (
        "piecewise: the fake of opaque op `fake_strides::contiguous_double` returns (3, 4) float32 with strides "
        "(1, 3), but the op returned strides (4, 1) on the same inputs (tensor inputs: (3, 4) float32). Compiled "
        "pieces assume the fake's strides: return contiguous tensors from both (x.new_empty(shape) in the fake), or "
        "make the fake's strides the op's (torch.empty_strided).")


@piecewise.opaque_op("fake_strides::keeps_layout")
def keeps_layout(x: torch.Tensor) -> torch.Tensor:
    return x * 2  # the argument's strides (TensorIterator keeps them), as the default fake's


def test_the_default_fake_follows_the_argument_and_an_op_that_does_too_is_left_as_it_is():
    transposed = torch.randn(4, 3).t()
    out = keeps_layout(transposed)
    torch.testing.assert_close(out, transposed * 2)
    assert out.stride() == transposed.stride()  # no copy
    check_fakes(["fake_strides::keeps_layout"], strides=True)  # no mismatch
