"""Never silently wrong, with state that adds up: the first call runs the forward many times (warm-up, padding
checks, a capture per size, ``compiler="auto"``'s timing). Writes that replace (cache rows, a table built on first
use) end where one call would; writes that add (vLLM's expert-load count for EPLB, a step counter in a buffer, a
histogram in a static argument) must hold the first call's share once, as eager does, and every later call's after
it. A refused first call leaves them as they were."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import piecewise
from piecewise.errors import ForwardRefused

MAX = 8
FRONTENDS = ["dynamo", "breakable", "auto"]
COUNTS = [5, 3, 1, 8, 9, 2]  # above the ladder's top too (the model's own forward)


@torch.library.custom_op("test_accumulated::count_experts", mutates_args=("load", "steps"))
def count_experts(load: torch.Tensor, steps: torch.Tensor, topk: torch.Tensor) -> None:
    """vLLM's EPLB load count: a custom op (not a splitting one) that adds each token's experts to a buffer, and
    counts its steps."""
    flat = topk.flatten()
    load.scatter_add_(0, flat, torch.ones_like(flat, dtype=load.dtype))
    steps.add_(1)


class Routed(nn.Module):
    """A top-2 router whose expert load and steps are counted into buffers. (An update from its own value in plain
    code, ``self.steps.add_(1)``, is refused at the first call by both front-ends: ``test_trust.py``.)"""

    def __init__(self, hidden: int = 16, experts: int = 8):
        super().__init__()
        self.embed, self.gate = nn.Embedding(64, hidden), nn.Linear(hidden, experts)
        self.experts = nn.Parameter(torch.randn(experts, hidden, hidden) * 0.1)
        self.register_buffer("load", torch.zeros(experts))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, ids):
        x = self.embed(ids)
        weights, topk = self.gate(x).softmax(-1).topk(2, -1)
        count_experts(self.load, self.steps, topk)
        return torch.einsum("th,tkhd->td", x, self.experts[topk] * weights[..., None, None])


def _twins():
    torch.manual_seed(0)
    model = Routed().eval()
    twin = Routed().eval()
    twin.load_state_dict(model.state_dict())
    return model, twin


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("compiler", ["eager", "auto"])
def test_a_count_added_to_on_every_run_holds_each_call_once(frontend, compiler):
    model, twin = _twins()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX, frontend=frontend, compiler=compiler))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for calls, tokens in enumerate(COUNTS, 1):
            ids = torch.randint(0, 64, (tokens,), generator=generator)
            torch.testing.assert_close(runner(ids), twin(ids))
            assert torch.equal(model.load, twin.load), (tokens, model.load, twin.load)
            assert int(model.steps) == calls, (tokens, int(model.steps))
    assert model.load.sum() == 2 * sum(COUNTS)


_LOADS: dict[str, torch.Tensor] = {}  # found by the layer's name, as vLLM's MoE op finds its layer's EPLB count


@torch.library.custom_op("test_accumulated::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, topk: torch.Tensor, layer: str) -> torch.Tensor:
    """vLLM's ``moe_forward``: the expert-load count is written through the layer it finds by name, not declared."""
    flat = topk.flatten()
    _LOADS[layer].scatter_add_(0, flat, torch.ones_like(flat, dtype=_LOADS[layer].dtype))
    return x.clone()


@moe_forward.register_fake
def _(x, topk, layer):
    return torch.empty_like(x)


class UndeclaredCount(Routed):
    """The count kept in an int32 buffer (vLLM's ``expert_load_pass``), the write hidden from the op's schema. The
    router's bias dominates (DeepSeek's ``e_score_correction_bias`` can): pad rows of zeros and copies of real rows
    count alike, so only the count of the rows tells the padding."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("load", torch.zeros(8, dtype=dtype))
        with torch.no_grad():
            self.gate.bias.copy_(torch.tensor([20.0, 10.0, 0, 0, 0, 0, 0, 0]))
        _LOADS["layer0"] = self.load

    def forward(self, ids):
        x = self.embed(ids)
        _, topk = self.gate(x).softmax(-1).topk(2, -1)
        return moe_forward(x, topk, "layer0")


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_a_count_an_op_writes_without_declaring_it_is_refused_or_exact(frontend, dtype):
    """Padded, the op counts the pad rows too. An integer count went unchecked: 8 for a call of 5 tokens."""
    torch.manual_seed(0)
    model = UndeclaredCount(dtype).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX, frontend=frontend))
    want = torch.zeros(8, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for index, tokens in enumerate(COUNTS):
            ids = torch.randint(0, 64, (tokens,), generator=generator)
            try:
                out = runner(ids)
            except ForwardRefused as refused:
                assert index == 0 and "mutates_args" in str(refused), refused
                assert torch.equal(model.load, want), "a refused first call left its counts behind"
                return
            torch.testing.assert_close(out, model.embed(ids))
            want.scatter_add_(0, model.gate(model.embed(ids)).softmax(-1).topk(2, -1)[1].flatten(),
                              torch.ones(2 * tokens, dtype=dtype))
            assert torch.equal(model.load, want), (tokens, model.load, want)


class Histogram(nn.Module):
    """A histogram the caller passes (a static argument), added to by a splitting op on the real rows."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Embedding(64, 16), nn.Linear(16, 16)

    def forward(self, ids, histogram):
        tally(ids, histogram)
        return self.out(self.embed(ids))


@piecewise.opaque_op("test_accumulated::tally", mutates_args=("histogram",), split=True)
def tally(ids: torch.Tensor, histogram: torch.Tensor) -> None:
    histogram.index_add_(0, ids, torch.ones_like(ids, dtype=histogram.dtype))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_static_argument_a_splitting_op_adds_to_holds_each_call_once(frontend):
    torch.manual_seed(0)
    model = Histogram().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX, frontend=frontend))
    histogram, want = torch.zeros(64), torch.zeros(64)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for tokens in COUNTS:
            ids = torch.randint(0, 64, (tokens,), generator=generator)
            torch.testing.assert_close(runner(ids, histogram), model(ids, want.clone()))
            want.index_add_(0, ids, torch.ones(tokens))
            assert torch.equal(histogram, want), tokens


class BuiltOnFirstUse(nn.Module):
    """A table filled on the first run only (a Python flag says so), read on every run: it must stay filled."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.register_buffer("table", torch.zeros(64, 16))
        self.built = False

    def forward(self, ids):
        if not self.built:
            self.table.copy_(torch.linspace(-1, 1, 64 * 16).view(64, 16))
            self.built = True
        return self.embed(ids) * self.table[ids]


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_table_built_on_first_use_stays_built(frontend):
    torch.manual_seed(0)
    model = BuiltOnFirstUse().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX, frontend=frontend))
    fresh = BuiltOnFirstUse().eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the flag set on the first run: the attributes' warning, not this test's
        for tokens in COUNTS:
            ids = torch.randint(0, 64, (tokens,))
            torch.testing.assert_close(runner(ids), fresh(ids))
    assert model.table.abs().sum() > 0


class MixedAfterCounting(Routed):
    """Counts, then reads across the rows (a softmax over the tokens): refused at the first call."""

    def forward(self, ids):
        return super().forward(ids).softmax(0)


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_refused_first_call_leaves_the_count_as_it_was(frontend):
    torch.manual_seed(0)
    model = MixedAfterCounting().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX, frontend=frontend))
    with torch.no_grad(), pytest.raises(ForwardRefused, match="mixes tokens"):
        runner(torch.randint(0, 64, (5,)))
    assert model.load.sum() == 0 and int(model.steps) == 0


class Sampler(nn.Module):
    """Samples in forward from a generator of the caller's (vLLM's per-request seeded sampling) or its own."""

    def __init__(self, held: bool):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 32)
        self.generator = torch.Generator().manual_seed(7) if held else None

    def forward(self, ids, generator=None):
        probs = self.head(self.embed(ids)).softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=generator or self.generator)
        return probs.div(noise).argmax(-1)


@pytest.mark.parametrize("held", [False, True], ids=["argument", "attribute"])
@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_generator_of_the_callers_is_put_back_after_the_rehearsals_and_the_draws_warned_of(frontend, held):
    """The rehearsals drew from it: the first call sampled other tokens than eager (5 of 5). Now it draws eager's
    numbers; later calls pad, so the generator moves on by the padded count: warned of at the first call."""
    torch.manual_seed(0)
    model = Sampler(held).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX, frontend=frontend))
    ids = torch.randint(0, 64, (MAX,))  # a capture size: no pad row draws
    generator = None if held else torch.Generator().manual_seed(7)
    with torch.no_grad(), pytest.warns(UserWarning, match="draws random numbers") as caught:
        got = runner(ids, generator)
    assert any("generator of your own" in str(w.message) for w in caught)
    twin = Sampler(held).eval()
    twin.load_state_dict(model.state_dict())
    theirs = None if held else torch.Generator().manual_seed(7)
    with torch.no_grad():
        want = twin(ids, theirs)
    assert torch.equal(got, want)
    ours = model.generator if held else generator  # moved on by one call's draws, as eager's
    assert torch.equal(ours.get_state(), (twin.generator if held else theirs).get_state())


STATES: dict[str, torch.Tensor] = {}
"""A forward context of recurrent states (vLLM's Mamba layers find theirs by layer name), a global of this file."""


@piecewise.opaque_op("test_accumulated::recur", fake=lambda x, name, seq: x.new_empty(x.shape), split=True)
def recur(x: torch.Tensor, name: str, seq: torch.Tensor) -> torch.Tensor:
    state = STATES[name]
    new = 0.9 * state[seq] + x
    state.index_copy_(0, seq, new)
    return new.clone()


class Recurrent(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name, self.embed, self.head = name, nn.Embedding(64, 16), nn.Linear(16, 16)

    def forward(self, ids, seq):
        return self.head(recur(self.embed(ids), self.name, seq))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_state_a_splitting_op_finds_through_a_global_holds_each_call_once(frontend):
    """Before, every rehearsal's update stayed in it (the outputs 8.4 off from the first call on)."""
    torch.manual_seed(0)
    model, twin = Recurrent("ours").eval(), Recurrent("theirs").eval()
    twin.load_state_dict(model.state_dict())
    STATES["ours"], STATES["theirs"] = torch.zeros(4, 16), torch.zeros(4, 16)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX, frontend=frontend))
    with torch.no_grad():
        for sequences in [[0, 1, 2], [1, 3], [2], [0, 1, 2, 3]]:
            ids, seq = torch.randint(0, 64, (len(sequences),)), torch.tensor(sequences)
            torch.testing.assert_close(runner(ids, seq), twin(ids, seq))
            torch.testing.assert_close(STATES["ours"], STATES["theirs"])


@torch.library.custom_op("test_accumulated::step", mutates_args=("state",))
def step(x: torch.Tensor, seq: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """A recurrent decode step per token (a custom op, not a splitting one): read the sequence's state, write it."""
    new = 0.9 * state[seq] + x
    state.index_copy_(0, seq, new)
    return new.clone()


@step.register_fake
def _(x, seq, state):
    return x.new_empty(x.shape)


class Holder:
    """A plain object on the model holding its state (a cache manager)."""

    def __init__(self):
        self.state = torch.zeros(4, 16)


class HeldState(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head, self.holder = nn.Embedding(64, 16), nn.Linear(16, 16), Holder()

    def forward(self, ids, seq):
        return self.head(step(self.embed(ids), seq, self.holder.state))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_state_held_by_a_plain_object_on_the_model_is_written_on_the_real_rows(frontend):
    """Breakable took the object's tensor for an activation: its write ran for the pad rows too, and the first call
    was refused as mixing tokens into state (Dynamo served it)."""
    torch.manual_seed(0)
    model, twin = HeldState().eval(), HeldState().eval()
    twin.load_state_dict(model.state_dict())
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX, frontend=frontend),
                               dynamic={"ids": 0, "seq": 0})
    with torch.no_grad():
        for sequences in [[0, 1, 2], [1, 3], [2], [0, 1, 2, 3], [3]]:
            ids, seq = torch.randint(0, 64, (len(sequences),)), torch.tensor(sequences)
            torch.testing.assert_close(runner(ids, seq), twin(ids, seq))
            torch.testing.assert_close(model.holder.state, twin.holder.state)
