"""Full graphs (``CaptureConfig.graph_mode``): which calls take the full-graph family, padded rows that never
write the cache, equality with eager over mixed decode and prefill calls, and the refusals. On a CPU the family
runs padded without graphs, with the splitting ops on the padded rows, exactly as inside a graph."""

from __future__ import annotations

import warnings

import pytest
import torch

import piecewise
from piecewise.models import example
from piecewise.models.decode import DecodeLlama
from piecewise.models.llama import LlamaConfig

FRONTENDS = ("dynamo", "breakable")
SMALL = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    intermediate_size=64, max_seq_len=32)


def llama():
    torch.manual_seed(0)
    model, (ids, positions, cache) = example(tokens=5, num_layers=2)
    cache.normal_()  # a cache full of other data: a pad row's write would show
    return model, ids, positions, cache


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_calls_up_to_max_decode_batch_take_the_full_graphs_and_the_rest_run_piecewise(frontend):
    model, ids, positions, cache = llama()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, max_decode_batch=4, frontend=frontend))
    with torch.no_grad():
        runner(ids, positions, cache)
        runner.stats.expect(graph_mode="full_and_piecewise", full_sizes=[1, 2, 4], frontend=frontend)
        for tokens, family in ((1, "full"), (3, "full"), (4, "full"), (5, "piecewise"), (16, "piecewise"),
                               (17, "direct")):
            before = dict(runner.stats)
            runner(torch.randint(0, 64, (tokens,)), torch.arange(tokens) + 2, cache)
            took = {"full": runner.stats["full_calls"] - before["full_calls"],
                    "piecewise": runner.stats["padded_calls"] - before["padded_calls"],
                    "direct": runner.stats["fallback_calls"] - before["fallback_calls"]}
            assert took == {name: int(name == family) for name in took}, (tokens, took)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_padded_rows_of_a_full_graph_never_write_the_cache(frontend):
    model, ids, positions, cache = llama()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend))
    with torch.no_grad():
        runner(ids, positions, cache)
        before = cache.clone()
        written = torch.tensor([9, 10, 11])  # 3 tokens padded to 4: one pad row, at position 0 (zero-filled)
        runner(torch.randint(0, 64, (3,)), written, cache)
    assert runner.stats["full_calls"] >= 1
    changed = (cache != before).flatten(3).any(-1)  # [layers, 2, positions]
    assert changed[:, :, written].all(), "the real rows' keys and values are written"
    others = torch.ones(cache.shape[2], dtype=torch.bool)
    others[written] = False
    assert not changed[:, :, others].any(), "a pad row wrote the cache at a position no real token has"


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_mixed_decode_and_prefill_calls_equal_eager(frontend, mode):
    model, ids, positions, cache = llama()
    reference = cache.clone()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, max_decode_batch=8, frontend=frontend))
    generator = torch.Generator().manual_seed(1)
    start = 0
    grad = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with grad():
        for tokens in (5, 1, 1, 7, 1, 3, 12, 1, 17, 2, 8, 9):
            ids = torch.randint(0, 64, (tokens,), generator=generator)
            positions = torch.arange(start, start + tokens) % 48
            start += tokens
            out = runner(ids, positions, cache)
            with torch.no_grad():
                ref = model(ids, positions, reference)
            assert not out.requires_grad
            assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), tokens
            assert torch.allclose(cache, reference, atol=1e-5, rtol=1e-5), tokens
    assert runner.stats["full_calls"] > 0 and runner.stats["padded_calls"] > 0


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_decode_batches_of_every_size_equal_eager_and_leave_other_sequences_alone(frontend):
    torch.manual_seed(0)
    model = DecodeLlama(SMALL).eval()
    cache = torch.randn(SMALL.num_layers, 2, 8, SMALL.num_kv_heads, SMALL.max_seq_len, SMALL.head_dim)
    reference = cache.clone()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad():
        for batch in (5, *range(1, 9)):
            ids = torch.randint(0, 64, (batch,))
            positions = torch.randint(0, SMALL.max_seq_len, (batch,))
            out = runner(ids, positions, cache)
            ref = model(ids, positions, reference)
            assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), batch
            assert torch.equal(cache, reference) or torch.allclose(cache, reference, atol=1e-6), batch
    runner.stats.expect(graph_mode="full_and_piecewise", full_sizes=[1, 2, 4, 8])


def test_a_model_with_a_splitting_op_that_cannot_be_captured_stays_piecewise():
    from piecewise.models.glm_moe import example as glm_example

    model, (ids, positions, cache) = glm_example(tokens=5, num_layers=2)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad():
        runner(ids, positions, cache)
    runner.stats.expect(graph_mode="piecewise", full_sizes=[], full_calls=0)
    assert "piecewise_examples::moe_experts" in runner.stats["graph_mode_reason"]
    with pytest.raises(ValueError, match=r"graph_mode='full'.*moe_experts.*capturable"):
        piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, graph_mode="full"))(ids, positions, cache)


def test_graph_mode_piecewise_and_bad_values():
    model, ids, positions, cache = llama()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, graph_mode="piecewise"))
    with torch.no_grad():
        runner(ids, positions, cache)
        runner(ids[:1], positions[:1], cache)
    runner.stats.expect(graph_mode="piecewise", full_calls=0)
    with pytest.raises(ValueError, match="graph_mode must be None or one of"):
        piecewise.CaptureConfig(graph_mode="whole")
    with pytest.raises(ValueError, match="max_decode_batch must be None or a positive int"):
        piecewise.CaptureConfig(max_decode_batch=0)


def test_graph_mode_full_runs_the_calls_the_full_graphs_do_not_serve_without_graphs():
    model, ids, positions, cache = llama()
    reference = cache.clone()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, graph_mode="full", frontend="breakable"))
    with torch.no_grad():
        for tokens in (5, 8, 9, 2):
            ids = torch.randint(0, 64, (tokens,))
            out = runner(ids, torch.arange(tokens) + 1, cache)
            assert torch.allclose(out, model(ids, torch.arange(tokens) + 1, reference), atol=1e-5)
    runner.stats.expect(graph_mode="full", full_sizes=[1, 2, 4, 8], full_calls=3, fallback_calls=1, padded_calls=0)


@piecewise.opaque_op("full_graph_tests::gated", split=True, capturable=lambda ctx: ctx.padded_tokens <= 2)
def gated(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(gated(self.linear(x)))


def test_an_op_that_accepts_only_some_calls_sends_the_others_piecewise():
    runner = piecewise.compile(Gated().eval(), piecewise.CaptureConfig(max_tokens=8))
    with torch.no_grad():
        runner(torch.randn(5, 8))
        assert runner.stats["graph_mode"] == "full_and_piecewise"
        calls = runner.stats["full_calls"]
        runner(torch.randn(2, 8))
        assert runner.stats["full_calls"] == calls + 1
        runner(torch.randn(3, 8))  # pads to 4: the op refuses, piecewise serves it
        assert runner.stats["full_calls"] == calls + 1


@piecewise.opaque_op("full_graph_tests::masked_mix", split=True, capturable=True)
def masked_mix(x: torch.Tensor) -> torch.Tensor:
    return x + x.sum(0)  # every row's sum: the caller zeroes the pad rows first


class ReadsTheTokenMask(torch.nn.Module):
    """Zeroes the pad rows itself, outside the splitting op, with ``context().token_mask`` (None outside a full
    graph): the mask is the runtime's, refilled before every replay, not a tensor frozen from outside."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear(x)
        ctx = piecewise.context()
        if ctx is not None and ctx.token_mask is not None:
            h = torch.where(ctx.token_mask[:, None], h, 0)
        return self.linear(masked_mix(h))


def test_breakable_keeps_the_full_graphs_of_a_forward_that_reads_the_token_mask_itself():
    """Breakable checks what its full graphs' runs read from outside the forward's arguments and the model: the
    runtime's own mask is not such a tensor. (Under Dynamo the mask, as long as the padded size, would specialise
    the trace to one count.)"""
    frontend = "breakable"
    torch.manual_seed(0)
    model = ReadsTheTokenMask().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens in (3, 1, 2, 3, 5, 7, 8):
            x = torch.randn(tokens, 8)
            torch.testing.assert_close(runner(x), model(x))
    assert not [str(w.message) for w in caught if "full graphs are off" in str(w.message)]
    runner.stats.expect(graph_mode="full_and_piecewise", frontend=frontend)
    assert runner.stats["full_calls"] == 7  # every call, the first one too


BIAS_OF_FULL_CALLS = torch.ones(8)


class ReadsAGlobalInFullCalls(ReadsTheTokenMask):
    """Reads a global tensor only on the path of full-graph calls (where the token mask is set)."""

    def forward(self, x):
        h = self.linear(x)
        ctx = piecewise.context()
        if ctx is not None and ctx.token_mask is not None:
            h = h + BIAS_OF_FULL_CALLS
        return self.linear(masked_mix(h))


def test_breakable_refuses_a_global_tensor_read_only_on_the_full_graphs_path():
    """A full graph would keep reading the global where the first call found it, after the caller replaced it:
    breakable checks its full-graph runs as it checks its piecewise ones, and refuses, naming the line."""
    runner = piecewise.compile(ReadsAGlobalInFullCalls().eval(), piecewise.CaptureConfig(max_tokens=8,
                                                                                          frontend="breakable"))
    with torch.no_grad(), pytest.raises(ValueError, match=r"`add` at .*h \+ BIAS_OF_FULL_CALLS.* reads a tensor of "
                                                          r"shape \(8,\) that is neither an argument") as info:
        runner(torch.randn(3, 8))
    assert info.value.kind == "frozen_value"


@piecewise.opaque_op("full_graph_tests::careless_mix", split=True, capturable=True)
def careless_mix(x: torch.Tensor) -> torch.Tensor:
    return x + x.sum(0)  # ignores the token mask: the pad rows reach every real row


class Careless(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(careless_mix(self.linear(x)))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_capturable_op_whose_pad_rows_change_the_real_rows_turns_the_full_graphs_off(frontend):
    runner = piecewise.compile(Careless().eval(), piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    with torch.no_grad(), pytest.warns(UserWarning, match=r"full graphs are off.*token_mask"):
        out = runner(torch.randn(3, 8))
    runner.stats.expect(graph_mode="piecewise", full_calls=0)
    assert out.shape == (3, 8)
    assert runner.verify().ok


def test_an_op_refusing_the_padded_batch_turns_full_graphs_off_with_its_message():
    """A cache of 4 sequences under full graphs up to 8 tokens: the first call's padded check hits the op's own
    error, and the runner goes on piecewise, equal to eager."""
    torch.manual_seed(0)
    model = DecodeLlama(SMALL).eval()
    cache = torch.randn(SMALL.num_layers, 2, 4, SMALL.num_kv_heads, SMALL.max_seq_len, SMALL.head_dim)
    reference = cache.clone()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8))
    ids, positions = torch.randint(0, 64, (4,)), torch.tensor([3, 9, 1, 30])
    with torch.no_grad(), pytest.warns(UserWarning, match=r"full graphs are off.*KV cache holds 4 sequences"):
        out = runner(ids, positions, cache)
    with torch.no_grad():
        assert torch.allclose(out, model(ids, positions, reference), atol=1e-5)
    runner.stats.expect(graph_mode="piecewise", full_sizes=[])


def test_the_padding_check_of_compiled_pieces_compares_them_with_themselves_not_with_eager(monkeypatch):
    """Compiled pieces round differently from eager (bf16 Inductor pieces by more than the tolerance): the check
    that padded rows leave the real rows alone must not take that for the padding's doing and turn full graphs
    off. Here every compiled piece is 10% off eager; the full graphs stay, and a careless op still turns them off.
    (Breakable's Inductor regions are still compared with eager.)"""
    frontend = "dynamo"
    from piecewise.capture import compilers

    def off_by_ten_percent(self, graph, example_inputs):
        return lambda *args: piecewise.capture.buffers.map_tensors(
            graph.forward(*args), lambda t: t * 1.1 if t.is_floating_point() else t)

    monkeypatch.setattr(compilers.InductorCompiler, "compile", off_by_ten_percent)
    model, ids, positions, cache = llama()
    config = piecewise.CaptureConfig(max_tokens=8, frontend=frontend, compiler="inductor")
    runner = piecewise.compile(model, config)
    with torch.no_grad():
        runner(ids, positions, cache)
    runner.stats.expect(graph_mode="full_and_piecewise")
    careless = piecewise.compile(Careless().eval(), config)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"full graphs are off.*token_mask"):
        careless(torch.randn(3, 8))


@piecewise.opaque_op("full_graph_tests::careless_write", split=True, capturable=True, mutates_args=("cache",))
def careless_write(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, positions, x)  # ignores the token mask: pad rows (position 0) write row 0
    return x + cache[0]  # which every row reads, as attention reads the first key


class CarelessWriter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, positions, cache):
        return self.linear(careless_write(self.linear(x), positions, cache))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_pad_rows_that_write_state_the_real_rows_read_turn_full_graphs_off_and_leave_the_state_alone(frontend):
    """The unpadded call runs before the padded one in the padding check, so a pad row's write into a row the
    real rows read shows in their outputs; the check puts the state back, so that the write does not stay."""
    torch.manual_seed(0)
    model = CarelessWriter().eval()
    cache = torch.randn(16, 8)
    reference = cache.clone()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend))
    x, positions = torch.randn(3, 8), torch.tensor([5, 6, 7])
    with torch.no_grad(), pytest.warns(UserWarning, match=r"full graphs are off.*token_mask"):
        out = runner(x, positions, cache)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x, positions, reference))
    torch.testing.assert_close(cache, reference)
    runner.stats.expect(graph_mode="piecewise")


class Scaled(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, positions, cache, scale):
        return self.model(ids, positions, cache) * scale.sum()


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_static_argument_that_cannot_be_written_is_left_out_of_the_padding_checks_state(frontend):
    """An expanded view (stride 0) as a static argument: nothing can write it, and copying it back would fail."""
    model, ids, positions, cache = llama()
    scale = torch.ones(1, 3).expand(2, 3)
    runner = piecewise.compile(Scaled(model), piecewise.CaptureConfig(max_tokens=16, frontend=frontend))
    reference = cache.clone()
    with torch.no_grad():
        out = runner(ids[:3], positions[:3], cache, scale)
        torch.testing.assert_close(out, model(ids[:3], positions[:3], reference) * 6)
    runner.stats.expect(graph_mode="full_and_piecewise")
