"""Never silently wrong, with CUDA graphs replayed: the classes of ``tests/test_trust.py`` where only graphs go
wrong (an address read at capture, a value kept at capture, a stream the capture cannot end, a device-side assert,
memory running out, another thread capturing), each right, refused with the reason, or warned about first, and the
CUDA context alive after every refusal."""

from __future__ import annotations

import os
import random
import sys
import threading
import warnings

import pytest
import torch
from torch import nn

import piecewise
from piecewise.errors import CaptureFailed, CaptureOutOfMemory, ForwardRefused

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import test_trust as cases  # noqa: E402

pytestmark = pytest.mark.gpu

MAX = 8
SIZES = range(1, MAX + 2)
FRONTENDS = ["dynamo", "breakable", "auto"]


def config(frontend: str, **options) -> piecewise.CaptureConfig:
    return piecewise.CaptureConfig(max_tokens=MAX, frontend=frontend, **options)


def ids(tokens: int) -> torch.Tensor:
    return torch.randint(0, 32, (tokens,), device="cuda")


def alive() -> None:
    """The context still runs kernels, syncs and draws random numbers."""
    torch.cuda.synchronize()
    assert torch.isfinite(torch.randn(16, device="cuda").sum())


def equal_at_every_size(model, runner, make, sizes=SIZES):
    for tokens in sizes:
        args = make(tokens)
        ours = runner(*args)
        with torch.no_grad():
            theirs = model(*args)
        for got, want in zip(torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(theirs)):
            assert got.shape == want.shape, (tokens, got.shape, want.shape)
            torch.testing.assert_close(got, want, msg=lambda m: f"{tokens} tokens: {m}")


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_replayed_graphs_give_splitting_ops_the_real_count_and_cut_outputs_along_their_token_dimension(frontend):
    torch.manual_seed(0)
    for model in (cases.CountPassing().cuda(), cases.FixedAndTransposed().cuda()):
        runner = piecewise.compile(model, config(frontend))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            equal_at_every_size(model, runner, lambda t: (ids(t),))
        assert runner.stats["cuda_graphs"] and runner.stats["replays"] > 0


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_dtype_switch_of_an_argument_runs_eagerly_and_is_right(frontend):
    torch.manual_seed(0)
    model = cases.Positional().cuda()
    runner = piecewise.compile(model, config(frontend))
    bias = torch.randn(8, device="cuda")
    x = ids(5)
    runner(x, torch.arange(5, device="cuda"), bias)
    with pytest.warns(UserWarning, match="dtype torch.int32"):
        out = runner(x, torch.arange(5, device="cuda", dtype=torch.int32), bias)
    torch.testing.assert_close(out, model(x, torch.arange(5, device="cuda", dtype=torch.int32), bias))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_parameter_given_other_memory_with_data_is_refused_and_copy_is_used(frontend):
    torch.manual_seed(0)
    model = cases.TwoLayers().cuda()
    runner = piecewise.compile(model, config(frontend))
    runner(ids(3))
    with torch.no_grad():
        model.second.weight.copy_(torch.randn(8, 8, device="cuda"))
    equal_at_every_size(model, runner, lambda t: (ids(t),))
    model.second.bias.data = torch.randn(8, device="cuda")  # not the first parameter: every one is watched
    with pytest.raises(ValueError, match=r"`second.bias` first: `.data = ...`"):
        runner(ids(3))
    alive()


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_autocast_switched_off_after_capture_under_it_runs_eagerly_and_is_right(frontend):
    torch.manual_seed(0)
    model = cases.Dropped().cuda().eval()
    runner = piecewise.compile(model, config(frontend))
    x = ids(5)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        runner(x)
    with pytest.warns(UserWarning, match="autocast"):
        out = runner(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(x))


class WithMetadata(nn.Module):
    """Attention metadata an engine sets on a module before each step (not an argument): a scale read in forward."""

    def __init__(self):
        super().__init__()
        self.embed, self.linear = nn.Embedding(32, 8), nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, x):
        return self.linear(self.embed(x)) * self.scale


def test_an_attribute_set_between_calls_that_breakable_graphs_read_is_refused_naming_it_and_the_line():
    torch.manual_seed(0)
    model = WithMetadata().cuda()
    runner = piecewise.compile(model, config("breakable"))
    runner(ids(3))
    model.scale = 2.0
    with pytest.raises(ValueError, match=r"`scale` was assigned after the first call, and the forward reads it at "
                                         r".*test_trust_gpu.py:\d+ \(`return self.linear\(self.embed\(x\)\) \* "
                                         r"self.scale`\)"):
        runner(ids(3))
    alive()


def test_an_attribute_set_between_calls_retraces_dynamo_and_stays_right():
    torch.manual_seed(0)
    model = WithMetadata().cuda()
    runner = piecewise.compile(model, config("dynamo"))
    runner(ids(3))
    model.scale = 2.0
    with pytest.warns(UserWarning, match="traced again"):
        x = ids(3)
        torch.testing.assert_close(runner(x), model(x))


@pytest.mark.parametrize("frontend", ["breakable", "dynamo", "auto"])
def test_a_python_random_draw_is_refused_or_drawn_each_call_never_frozen(frontend):
    model = cases.PythonRandom().cuda()
    runner = piecewise.compile(model, config(frontend))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if frontend == "breakable":
            with pytest.raises(ForwardRefused, match="random.random"):
                runner(ids(3))
            alive()
            return
        for tokens in [3, *SIZES]:
            x = ids(tokens)
            random.seed(tokens)
            ours = runner(x)
            random.seed(tokens)
            torch.testing.assert_close(ours, model(x))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_plain_python_attention_sized_on_the_host_is_refused_with_its_line_not_nan(frontend):
    model = cases.PlainAttention().cuda()
    runner = piecewise.compile(model, config(frontend))
    cache = torch.zeros(32, 8, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((CaptureFailed, ForwardRefused), match=r"int\(positions.max\(\)\)"):
            runner(ids(3), torch.arange(3, device="cuda") + 3, cache)
    alive()


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_branch_on_the_token_count_is_served_where_the_ladder_bounds_it_and_refused_elsewhere(frontend):
    torch.manual_seed(0)
    model = cases.Threshold().cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ForwardRefused, match="token"):
            piecewise.compile(model, config(frontend))(ids(7))
        if frontend != "dynamo":
            model = cases.DecodePath().cuda()
            runner = piecewise.compile(model, config(frontend))
            equal_at_every_size(model, runner, lambda t: (ids(t),))
    alive()


class SideStream(nn.Module):
    """A side stream forked in forward and joined after the splitting op that follows it."""

    def __init__(self):
        super().__init__()
        self.embed, self.first, self.second = nn.Embedding(32, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.side = None

    def forward(self, x):
        h = self.first(self.embed(x))
        if self.side is None:
            self.side = torch.cuda.Stream()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            g = self.second(h) * 3
        a = cases.seen_tokens(h)  # a splitting op before the join
        torch.cuda.current_stream().wait_stream(self.side)
        return a + g


@pytest.mark.parametrize("frontend", ["breakable", "auto"])
def test_a_side_stream_left_open_at_a_splitting_op_is_joined_and_the_graphs_are_right(frontend):
    torch.manual_seed(0)
    model = SideStream().cuda()
    runner = piecewise.compile(model, config(frontend))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto: Dynamo cannot split around the streams, and says so
        equal_at_every_size(model, runner, lambda t: (ids(t),))
    assert runner.stats["frontend"] == "breakable" and runner.stats["replays"] > 0


def test_dynamo_names_the_streams_it_cannot_split_around():
    model = SideStream().cuda()
    runner = piecewise.compile(model, config("dynamo"))
    with pytest.raises(ForwardRefused, match=r"works with CUDA streams") as refused:
        runner(ids(3))
    assert refused.value.kind == "side_stream"
    alive()


class EventFork(SideStream):
    """A fork through an event recorded on a stream piecewise does not see as the capture's, never joined before
    the splitting op: the capture cannot end; the error names the stretch and the context stays usable."""

    def forward(self, x):
        h = self.first(self.embed(x))
        if self.side is None:
            self.side = torch.cuda.Stream()
        self.side.wait_event(torch.cuda.current_stream().record_event())
        with torch.cuda.stream(self.side):
            g = self.second(h) * 3
        a = cases.seen_tokens(h)
        torch.cuda.current_stream().wait_stream(self.side)
        return a + g


def test_a_fork_through_an_event_is_joined_too():
    torch.manual_seed(0)
    model = EventFork().cuda()
    runner = piecewise.compile(model, config("breakable"))
    equal_at_every_size(model, runner, lambda t: (ids(t),))
    alive()


class Cubic(nn.Module):
    """Memory that grows with the cube of the token count: 32 GiB at 8 tokens, out of memory from 16 on."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, x):
        scratch = torch.ones(x.shape[0] ** 3 << 24, device=x.device)
        return self.embed(x) + scratch[:1]


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_out_of_memory_while_preparing_the_graphs_says_so_with_the_sizes_and_what_to_lower(frontend):
    runner = piecewise.compile(Cubic().cuda(), piecewise.CaptureConfig(max_tokens=64, frontend=frontend))
    with pytest.raises(CaptureOutOfMemory, match=r"ran out of memory .* 64 tokens .*max_tokens \(now 64\)"):
        runner(ids(3))
    torch.cuda.empty_cache()
    alive()


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_runner_capturing_while_another_thread_serves_its_own(frontend):
    """One thread serves a runner whose splitting op draws random numbers (a sampler) while another thread makes a
    second runner's first call, which captures: neither fails, both equal eager."""

    @piecewise.opaque_op(f"test_trust_gpu::sample_{frontend}", split=True)
    def sample(x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x) * 0

    class Sampler(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 8)

        def forward(self, x):
            return sample(self.embed(x))

    torch.manual_seed(0)
    serving, capturing = Sampler().cuda(), cases.TwoLayers().cuda()
    first = piecewise.compile(serving, config(frontend))
    first(ids(3))
    second = piecewise.compile(capturing, piecewise.CaptureConfig(max_tokens=256, frontend=frontend))
    failures = []

    def serve():
        try:
            for step in range(200):
                x = ids(1 + step % MAX)
                torch.testing.assert_close(first(x), serving(x))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    thread = threading.Thread(target=serve)
    with torch.no_grad():
        thread.start()
        x = ids(5)
        torch.testing.assert_close(second(x), capturing(x))
        thread.join()
    assert not failures, failures
    alive()


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_position_table_smaller_than_the_top_size_is_no_device_assert(frontend):
    torch.manual_seed(0)
    model = cases.LearnedPositions(table=40).cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=128, frontend=frontend))
    with pytest.warns(UserWarning, match=r"Sizes above 40 are not captured"):
        runner(ids(3))
    assert runner.stats["capture_sizes"][-1] == 40 and runner.stats["cuda_graphs"]
    equal_at_every_size(model, runner, lambda t: (ids(t),), sizes=[1, 7, 33, 40])
    alive()
