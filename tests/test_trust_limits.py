"""Never silently wrong at the model's own limits: a forward that takes at most N rows (a pipeline stage's
hidden-state and residual buffers of N rows, sliced by the count, as vLLM's intermediate tensors are) gets graphs up
to the largest capture size it runs padded, one warning naming the line, and calls above run the model's own
forward; a ``dynamic=`` that leaves out an argument with one row per token is named in the refusal."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import piecewise
from piecewise.errors import ForwardRefused

ROWS = 12


@torch.library.custom_op("test_limits::fused_add_norm", mutates_args=("x", "residual"))
def fused_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    """vLLM's fused_add_rms_norm: residual += x, then x = norm(residual), both in place."""
    residual.add_(x)
    x.copy_(residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * weight)


class Stage(nn.Module):
    """A later pipeline stage: the previous stage's hidden states and residual arrive in buffers of ROWS rows."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(64, hidden)
        self.norms = nn.ParameterList(nn.Parameter(torch.ones(hidden)) for _ in range(2))
        self.linears = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(2))

    def forward(self, input_ids, positions, hidden_states, residual):
        n = input_ids.shape[0]
        x, residual = hidden_states[:n] + self.embed(input_ids), residual[:n]
        for norm, linear in zip(self.norms, self.linears):
            fused_add_norm(x, residual, norm)
            x = linear(x)
        return x


def _buffers(generator):
    return torch.randn(ROWS, 16, generator=generator), torch.randn(ROWS, 16, generator=generator)


@pytest.mark.parametrize("frontend", ["breakable", "auto"])
def test_sizes_past_the_models_own_row_limit_are_left_out_with_one_warning_naming_the_line(frontend):
    torch.manual_seed(0)
    model = Stage().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=64, frontend=frontend),
                               dynamic={"input_ids": 0, "positions": 0})
    generator = torch.Generator().manual_seed(1)
    hidden, residual = _buffers(generator)  # the runner's static arguments: the same tensors, refilled each step
    with torch.no_grad():
        for calls, tokens in enumerate([5, 3, ROWS, 1, 7]):
            new_hidden, new_residual = _buffers(generator)
            hidden.copy_(new_hidden), residual.copy_(new_residual)
            ids = torch.randint(0, 64, (tokens,), generator=generator)
            theirs = new_residual.clone()
            want = model(ids, torch.arange(tokens), new_hidden.clone(), theirs)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = runner(ids, torch.arange(tokens), hidden, residual)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(residual, theirs)  # the caller's buffer updated in place, as eagerly
            limits = [w for w in caught if "own forward refuses" in str(w.message)]
            assert len(limits) == (calls == 0), [str(w.message) for w in caught]
            if limits:
                message = str(limits[0].message)
                assert "hidden_states[:n]" in message and "max_tokens=8" in message, message
                assert limits[0].filename == __file__
    assert max(runner.stats.capture_sizes) == 8  # the ladder's largest size within ROWS
    with torch.no_grad(), pytest.raises(RuntimeError, match="size of tensor"):
        runner(torch.randint(0, 64, (ROWS + 1,)), torch.arange(ROWS + 1), hidden, residual)  # the model's own


def test_a_dynamic_that_leaves_out_arguments_with_a_row_per_token_names_them():
    torch.manual_seed(0)

    class Unsliced(Stage):
        def forward(self, input_ids, positions, hidden_states, residual):
            x, residual = hidden_states + self.embed(input_ids), residual.clone()
            for norm, linear in zip(self.norms, self.linears):
                fused_add_norm(x, residual, norm)
                x = linear(x)
            return x

    model = Unsliced().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8), dynamic={"input_ids": 0, "positions": 0})
    with torch.no_grad(), pytest.raises(ForwardRefused) as refused:
        runner(torch.randint(0, 64, (5,)), torch.arange(5), torch.randn(5, 16), torch.randn(5, 16))
    assert "dynamic={'input_ids': 0, 'positions': 0, 'hidden_states': 0, 'residual': 0}" in str(refused.value)


def test_a_row_limit_from_a_static_argument_as_long_as_the_first_call_names_the_dynamic_to_pass():
    torch.manual_seed(0)
    model = Stage().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8), dynamic={"input_ids": 0, "positions": 0})
    hidden, residual = torch.randn(5, 16), torch.randn(5, 16)
    with torch.no_grad(), pytest.warns(UserWarning, match="own forward refuses") as caught:
        got = runner(torch.arange(5), torch.arange(5), hidden, residual.clone())
    message = next(str(w.message) for w in caught if "own forward refuses" in str(w.message))
    assert "'hidden_states' has shape (5, 16)" in message and "'hidden_states': 0" in message, message
    torch.testing.assert_close(got, model(torch.arange(5), torch.arange(5), hidden, residual.clone()))


class Temperature(nn.Module):
    """Per-token temperatures divide the logits, then a draw: a zero temperature (the pad rows') gives NaN."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 32)

    def forward(self, ids, temperature):
        probs = (self.head(self.embed(ids)) / temperature[:, None]).softmax(-1)
        return torch.multinomial(probs, 1)[:, 0]


@pytest.mark.parametrize("frontend", ["dynamo", "breakable", "auto"])
def test_a_forward_that_cannot_take_the_pad_rows_zeros_is_refused_naming_them(frontend):
    """Before, the model's own error from inside the padding check (breakable: a raw RuntimeError)."""
    runner = piecewise.compile(Temperature(), piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad(), pytest.raises(ForwardRefused, match=r"the rest zeros\), the forward raises RuntimeError: "
                                                               r"probability tensor.*temperature\.clamp_min"):
        runner(torch.randint(0, 64, (5,)), torch.rand(5) + 0.5)


CONTEXT: dict[str, torch.Tensor] = {}
"""vLLM's forward context: per-token slots set in a global before each step, a new tensor of the step's rows."""


class FromContext(nn.Module):
    def __init__(self, sliced: bool):
        super().__init__()
        self.sliced, self.embed, self.q = sliced, nn.Embedding(64, 16), nn.Linear(16, 16)
        self.register_buffer("cache", torch.zeros(32, 4, 4))

    def forward(self, ids):
        q = self.q(self.embed(ids)).reshape(-1, 4, 4)
        if self.sliced:
            self.cache.index_copy_(0, CONTEXT["slots"][: q.shape[0]], q)
        else:
            self.cache[CONTEXT["slots"]] = q
        return q.sum(-1)


def test_per_token_slots_read_from_a_global_are_named_as_the_rows_that_stayed_the_first_calls():
    CONTEXT["slots"], CONTEXT["ids"] = torch.arange(5), torch.arange(5)  # the call's own ids held in a global too
    runner = piecewise.compile(FromContext(sliced=False), piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad(), pytest.raises(ForwardRefused, match=r"read from a global do not carry tokens.*"
                                                               r"global `[\w.]*test_trust_limits\.CONTEXT\['slots'\]` "
                                                               r"kept the first call's 5 rows") as refused:
        runner(CONTEXT["ids"])
    assert "CONTEXT['ids']" not in str(refused.value)
    del CONTEXT["ids"]


def test_auto_names_what_every_front_end_refused():
    """Dynamo sees a condition on the count (the slice of a global of the first call's rows); breakable names the
    read itself: both are in the refusal."""
    CONTEXT["slots"] = torch.arange(5)
    runner = piecewise.compile(FromContext(sliced=True), piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad(), warnings.catch_warnings(), pytest.raises(ForwardRefused) as refused:
        warnings.simplefilter("ignore")
        runner(torch.arange(5))
    message = str(refused.value)
    assert "depends on the token count" in message, message
    assert "The breakable front-end refused it too" in message and "CONTEXT[\"slots\"][: q.shape[0]]" in message


class Concatenated(nn.Module):
    """Returns two per-token tensors concatenated along the tokens ([2T, V]), as a draft-and-target step might."""

    def __init__(self):
        super().__init__()
        self.embed, self.a, self.b = nn.Embedding(64, 16), nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, ids):
        x = self.embed(ids)
        return torch.cat([self.a(x), self.b(x)])


@pytest.mark.parametrize("frontend", ["dynamo", "auto"])
def test_an_output_with_more_rows_than_tokens_is_refused_saying_so(frontend):
    """Before, only 'the forward mixes tokens: a sum, softmax... over the tokens', which it does not."""
    runner = piecewise.compile(Concatenated(), piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad(), pytest.raises(ForwardRefused, match=r"rows for \d+ padded tokens are not one per token: a "
                                                               r"cat of two per-token tensors"):
        runner(torch.randint(0, 64, (5,)))
