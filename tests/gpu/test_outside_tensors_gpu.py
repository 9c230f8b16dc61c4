"""Tensors a forward reads from outside its arguments and modules (a global forward context, as vLLM and SGLang
engines keep one), replaced by a new tensor before each call, with graphs really captured and replayed: each call
must read the new tensor, or be refused; never the first call's memory."""

import contextlib
import warnings

import pytest
import torch

import piecewise
from piecewise.errors import ForwardRefused

pytestmark = pytest.mark.gpu


class Context:
    bias: torch.Tensor


CONTEXT = Context()


class ReadsTheContext(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, input_ids):
        return self.head(torch.relu(self.embed(input_ids) + CONTEXT.bias))


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_global_tensor_replaced_before_each_call_is_read_or_refused(frontend):
    torch.manual_seed(0)
    model = ReadsTheContext().cuda().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    refused = None
    with torch.no_grad():
        try:
            for tokens in (3, 3, 5, 1, 8, 2):
                CONTEXT.bias = torch.randn(16, device="cuda")  # a new tensor, another address, every call
                ids = torch.randint(0, 64, (tokens,), device="cuda")
                torch.testing.assert_close(runner(ids), model(ids), msg=lambda m: f"a call of {tokens}: {m}")
        except ForwardRefused as exc:  # refusing is allowed; reading the first call's memory is not
            refused = exc
    if refused is None:
        assert runner.stats.replays + runner.stats.full_replays > 0  # the graphs really served the calls
    else:
        assert "bias" in str(refused), str(refused)


# A KV-cache write as recent vLLM makes it: its own custom op (not a splitting op, no declared mutation) that looks
# its layer up by name and reads the step's slot mapping from the engine's forward context.
SLOTS: dict[str, torch.Tensor] = {}
LAYERS: dict[str, torch.nn.Module] = {}


@torch.library.custom_op("piecewise_test::kv_update_from_context", mutates_args=())
def kv_update_from_context(key: torch.Tensor, layer: str) -> torch.Tensor:
    cache = LAYERS[layer].cache
    slots = SLOTS["slots"][: key.shape[0]]  # -1 past the real tokens: the padding rows write nothing
    keep = slots >= 0
    index = torch.where(keep, slots, 0)
    cache.index_copy_(0, index, torch.where(keep[:, None], key, cache[index]))
    return key.new_empty(0)


@kv_update_from_context.register_fake
def _(key, layer):
    return key.new_empty(0)


@piecewise.opaque_op("piecewise_test::attend_cache", mutates_args=(), split=True)
def attend_cache(query: torch.Tensor, written: torch.Tensor, layer: str) -> torch.Tensor:  # after the write, as vLLM
    # orders them (its attention takes the update's result as a dependency)
    cache = LAYERS[layer].cache[1: SLOTS["length"] + 1]
    return (query @ cache.T).softmax(-1) @ cache


class CacheLayer(torch.nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.proj = torch.nn.Linear(16, 16)
        self.cache = torch.zeros(65, 16)
        LAYERS[name] = self

    def forward(self, x):
        key = self.proj(x)
        written = torch.ops.piecewise_test.kv_update_from_context(key, self.name)
        return x + attend_cache(key, written, self.name)


class CacheModel(torch.nn.Module):
    def __init__(self, prefix: str):
        super().__init__()
        self.layers = torch.nn.ModuleList(CacheLayer(f"{prefix}.{i}") for i in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@contextlib.contextmanager
def _record(messages: list[str]):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    messages += [str(w.message) for w in caught]


def _twins(prefix: str):
    torch.manual_seed(0)
    model, eager = CacheModel(prefix + ".graphs"), CacheModel(prefix + ".eager")
    eager.load_state_dict(model.state_dict())
    for m in (model, eager):
        m.cuda().eval()
        for layer in m.layers:
            layer.cache = layer.cache.cuda()
    return model, eager


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_custom_op_reading_a_new_slot_mapping_from_the_forward_context_every_step_stays_right(frontend, compiler):
    model, eager = _twins(f"new{frontend}{compiler}")
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4, 8], frontend=frontend,
                                                              compiler=compiler, cache_dir=None))
    start, warnings_seen = 0, []
    with torch.no_grad():
        for tokens in (1, 1, 1, 3, 1, 2, 5, 1):
            x = torch.randn(tokens, 16, device="cuda")
            for target in (eager, runner):  # a new slot mapping for each, as an engine makes one every step
                slots = torch.full((64,), -1, dtype=torch.long, device="cuda")
                slots[:tokens] = torch.arange(start + 1, start + 1 + tokens, device="cuda")
                SLOTS.update(slots=slots, length=start + tokens)
                if target is runner:
                    with _record(warnings_seen):
                        got = runner(x)
                else:
                    want = eager(x)
            torch.testing.assert_close(got, want, msg=lambda m: f"a call of {tokens}: {m}")
            for a, b in zip(model.layers, eager.layers):
                torch.testing.assert_close(a.cache, b.cache, msg=lambda m: f"the cache after a call of {tokens}: {m}")
            start += tokens
    assert runner.stats.outside_reads and "kv_update_from_context" in runner.stats.outside_reads[0]
    assert runner.stats.eager_calls > 0
    assert any("kv_update_from_context" in w and "own forward" in w for w in warnings_seen), warnings_seen


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_custom_op_reading_a_persistent_slot_buffer_filled_in_place_is_replayed(frontend):
    model, eager = _twins(f"kept{frontend}")
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4, 8], frontend=frontend,
                                                              compiler="eager", cache_dir=None))
    buffer = torch.full((64,), -1, dtype=torch.long, device="cuda")
    start, warnings_seen = 0, []
    with torch.no_grad():
        for tokens in (1, 1, 3, 1, 2, 5, 1):
            x = torch.randn(tokens, 16, device="cuda")
            buffer.fill_(-1)
            buffer[:tokens] = torch.arange(start + 1, start + 1 + tokens, device="cuda")
            SLOTS.update(slots=buffer[:], length=start + tokens)  # a new view of the one buffer, as vLLM slices
            want = eager(x)
            with _record(warnings_seen):
                got = runner(x)
            torch.testing.assert_close(got, want, msg=lambda m: f"a call of {tokens}: {m}")
            for a, b in zip(model.layers, eager.layers):
                torch.testing.assert_close(a.cache, b.cache)
            start += tokens
    assert runner.stats.eager_calls == 0 and runner.stats.replays > 0, (runner.stats, warnings_seen)
    assert not any("kv_update_from_context" in w for w in warnings_seen), warnings_seen
