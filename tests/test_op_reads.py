"""What a custom op captured into a graph reads from outside its arguments (``runtime/op_reads.py``), seen on CPU
with the capture flag set: the GPU tests (``tests/gpu/test_outside_tensors_gpu.py``) run it under real captures."""

import gc
import types

import pytest
import torch

import piecewise
from piecewise.runtime import op_reads

CONTEXT: dict[str, torch.Tensor] = {}


@torch.library.custom_op("piecewise_reads::from_context", mutates_args=())
def from_context(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    stashed = CONTEXT.get("stashed")
    out = x @ weight + CONTEXT["table"][: x.shape[0]]  # the line that reads the global
    return out if stashed is None else out + stashed.sum()


@from_context.register_fake
def _(x, weight):
    return torch.empty_like(x)


@piecewise.opaque_op("piecewise_reads::split_reader", mutates_args=(), split=True)
def split_reader(x: torch.Tensor) -> torch.Tensor:
    return x + CONTEXT["split"][: x.shape[0]]


class Reads(torch.nn.Module):
    def __init__(self, stash: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.stash = stash

    def forward(self, x):
        if self.stash:
            CONTEXT["stashed"] = x * 2  # made by the forward: its graph recomputes it where the op reads it
        return split_reader(torch.ops.piecewise_reads.from_context(x, self.weight))


def _watched(model, x, monkeypatch):
    monkeypatch.setattr(op_reads, "stream_capturing", lambda: True)
    watch = op_reads.watching(model, frozenset({"piecewise_reads::split_reader"}))
    with torch.inference_mode(), watch:
        model(x)
    monkeypatch.undo()
    return op_reads.settle(watch)


@pytest.fixture(autouse=True)
def _clean_context():
    CONTEXT.clear()
    yield
    CONTEXT.clear()


def test_a_global_read_inside_a_captured_custom_op_is_named_and_its_replacement_seen(monkeypatch):
    CONTEXT.update(table=torch.randn(8, 4), split=torch.randn(8, 4))
    reads = _watched(Reads(), torch.randn(3, 4), monkeypatch)
    assert len(reads) == 1, [str(r) for r in reads]  # not the op's arguments, its parameter, the splitting op's read
    text = str(reads[0])
    assert "`piecewise_reads::from_context`" in text and "(8, 4) float32" in text, text
    assert "test_op_reads.py" in text and 'CONTEXT["table"]' in text, text  # the op's own line
    assert "held at `CONTEXT['table']`" in text, text
    assert op_reads.stale(reads) is None
    kept = CONTEXT["table"]  # the engine keeps last step's tensor alive (an overlapped scheduler)
    CONTEXT["table"] = torch.randn(8, 4)
    message = op_reads.stale(reads)
    assert message is not None and "`CONTEXT['table']` now holds another tensor" in message, message
    assert "splitting op" in message and "argument" in message and "own forward" in message, message
    CONTEXT["table"] = kept  # put back: the graphs read it again
    assert op_reads.stale(reads) is None
    del kept
    CONTEXT["table"] = torch.randn(8, 4)  # a new tensor, the old one dropped
    gc.collect()
    message = op_reads.stale(reads)
    assert message is not None and "freed since the first call" in message, message


FORWARD_CONTEXT = types.ModuleType("engine_forward_context")  # an engine's module, as vLLM's forward_context


@torch.library.custom_op("piecewise_reads::from_module_context", mutates_args=())
def from_module_context(x: torch.Tensor) -> torch.Tensor:
    return x + FORWARD_CONTEXT.current.metadata.bias[: x.shape[0]]


@from_module_context.register_fake
def _(x):
    return torch.empty_like(x)


class ReadsModuleContext(torch.nn.Module):
    def forward(self, x):
        return torch.ops.piecewise_reads.from_module_context(x)


def test_a_tensor_reached_through_an_engine_module_and_objects_is_followed_there(monkeypatch):
    FORWARD_CONTEXT.current = types.SimpleNamespace(metadata=types.SimpleNamespace(bias=torch.randn(8, 4)))
    reads = _watched(ReadsModuleContext(), torch.randn(3, 4), monkeypatch)
    assert [r.path for r in reads] == [("FORWARD_CONTEXT", ("attr", "current"), ("attr", "metadata"),
                                        ("attr", "bias"))], [str(r) for r in reads]
    kept = FORWARD_CONTEXT.current
    FORWARD_CONTEXT.current = None  # outside the engine's context: nothing to compare
    assert op_reads.stale(reads) is None
    FORWARD_CONTEXT.current = types.SimpleNamespace(metadata=types.SimpleNamespace(bias=torch.randn(8, 4)))
    message = op_reads.stale(reads)
    assert message is not None and "`FORWARD_CONTEXT.current.metadata.bias` now holds another tensor" in message
    FORWARD_CONTEXT.current = kept


@pytest.mark.parametrize("made", ["plain", "inference_mode"])
def test_a_new_view_of_one_persistent_buffer_each_step_stays_the_same_tensor(monkeypatch, made):
    with torch.inference_mode(made == "inference_mode"):  # views of an inference tensor have no _base
        buffer = torch.randn(8, 4)
        CONTEXT.update(table=buffer[:6], split=torch.randn(8, 4))
    reads = _watched(Reads(), torch.randn(3, 4), monkeypatch)
    assert len(reads) == 1
    with torch.inference_mode(made == "inference_mode"):
        CONTEXT["table"] = buffer[:5]  # vLLM slices its persistent metadata buffers anew every step
        CONTEXT["table"] = CONTEXT["table"].detach()
    gc.collect()
    assert op_reads.stale(reads) is None


def test_the_models_own_tensor_attributes_and_sparse_results_are_no_outside_reads(monkeypatch):
    SLOTS.update(slots=torch.arange(4))
    model = Registered()
    reads = _watched(model, torch.randn(4, 8), monkeypatch)
    assert [r.shape for r in reads] == [(4,)], [str(r) for r in reads]  # the slot mapping, not the layer's cache

    class Sparse(torch.nn.Module):
        def forward(self, x):
            return torch.ops.piecewise_reads.from_context(x.to_sparse().to_dense(), torch.eye(4))

    CONTEXT.update(table=torch.randn(8, 4))
    assert len(_watched(Sparse(), torch.randn(3, 4), monkeypatch)) == 1


@torch.library.custom_op("piecewise_reads::pure_unused", mutates_args=())
def pure_unused(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0, keepdim=True)


@pure_unused.register_fake
def _(x):
    return x.sum(0, keepdim=True)


class PureUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x)
        torch.ops.piecewise_reads.pure_unused(h.reshape(-1))  # a debug statistic nobody reads
        return h * 2


def test_an_unused_custom_op_stays_in_its_piece_with_eager_pieces():
    model = PureUnused()
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4], compiler="eager",
                                                              frontend="dynamo", cache_dir=None))
    with torch.no_grad():
        for tokens in (3, 1, 4):
            x = torch.randn(tokens, 4)
            torch.testing.assert_close(runner(x), model(x))
    assert runner.stats.eager_writes == 0 and runner.stats.pieces == 1, runner.stats


def test_a_tensor_the_forward_made_and_stashed_in_a_global_is_never_stale_nor_news_to_the_doctor(monkeypatch):
    CONTEXT.update(table=torch.randn(8, 4), split=torch.randn(8, 4))
    model, x = Reads(stash=True), torch.randn(3, 4)
    reads = _watched(model, x, monkeypatch)  # captures note no made tensors: it is read, and held where it was put
    assert op_reads.stale(reads) is None  # replays run no Python: nothing puts another there
    watch = op_reads.watching(model, frozenset({"piecewise_reads::split_reader"}), always=True)
    with torch.inference_mode(), watch:
        model(x)
    assert [r.shape for r in watch.reads.values()] == [(8, 4)], [str(r) for r in watch.reads.values()]


def test_outside_a_capture_nothing_is_watched():
    CONTEXT.update(table=torch.randn(8, 4), split=torch.randn(8, 4))
    model = Reads()
    watch = op_reads.watching(model, frozenset({"piecewise_reads::split_reader"}))
    with torch.inference_mode(), watch:
        out = model(torch.randn(3, 4))
    assert op_reads.settle(watch) == [] and out.shape == (3, 4)


# A KV-cache write as its own custom op that declares no write (``mutates_args=()``) and whose result goes unused:
# a compiler removes it from a piece as dead code, so it must run eagerly between the pieces.
SLOTS: dict[str, torch.Tensor] = {}
CACHES: dict[str, torch.Tensor] = {}


@torch.library.custom_op("piecewise_reads::write_undeclared", mutates_args=())
def write_undeclared(key: torch.Tensor, layer: str) -> torch.Tensor:
    cache = CACHES[layer]
    slots = SLOTS["slots"][: key.shape[0]]  # -1 past the real tokens: padding rows keep the spare row as it is
    keep = slots >= 0
    index = torch.where(keep, slots, cache.shape[0] - 1)
    cache.index_copy_(0, index, torch.where(keep[:, None], key, cache[index]))
    return key.new_empty(0)


@write_undeclared.register_fake
def _(key, layer):
    return key.new_empty(0)


@piecewise.opaque_op("piecewise_reads::read_cache", mutates_args=(), split=True)
def read_cache(query: torch.Tensor, layer: str) -> torch.Tensor:
    cache = CACHES[layer][: SLOTS["length"]]
    return (query @ cache.T).softmax(-1) @ cache


class UndeclaredWrite(torch.nn.Module):
    def __init__(self, prefix: str):
        super().__init__()
        self.names = [f"{prefix}.{i}" for i in range(2)]
        self.proj = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in self.names)

    def forward(self, x):
        for name, proj in zip(self.names, self.proj):
            key = proj(x)
            torch.ops.piecewise_reads.write_undeclared(key, name)  # the result is not used
            x = x + read_cache(key, name)
        return x


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_custom_op_that_writes_without_declaring_it_is_not_dropped_by_inductor(frontend):
    torch.manual_seed(0)
    model, eager = UndeclaredWrite(f"compiled.{frontend}"), UndeclaredWrite(f"eager.{frontend}")
    eager.load_state_dict(model.state_dict())
    for name in model.names + eager.names:
        CACHES[name] = torch.zeros(32, 8)
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4], compiler="inductor",
                                                              frontend=frontend, cache_dir=None))
    start = 0
    with torch.no_grad():
        for tokens in (1, 1, 3, 2, 1):
            x = torch.randn(tokens, 8)
            slots = torch.full((8,), -1)  # a new tensor each step, as an engine makes one
            slots[:tokens] = torch.arange(start, start + tokens)
            SLOTS.update(slots=slots, length=start + tokens)
            want, got = eager(x), runner(x)
            torch.testing.assert_close(got, want, msg=lambda m: f"a call of {tokens} after {start}: {m}")
            for a, b in zip(model.names, eager.names):
                torch.testing.assert_close(CACHES[a], CACHES[b], msg=lambda m: f"the cache after {start}: {m}")
            start += tokens
    assert runner.stats.eager_writes >= 2, runner.stats  # both layers' writes run between the pieces


def _engine_getter():
    """vLLM's shape: the op calls a getter of another module's global (that module not named here)."""
    engine = types.ModuleType("engine_context")
    exec("_context = None\ndef get_context():\n    return _context\n", vars(engine))
    return engine.get_context


get_context = _engine_getter()


@torch.library.custom_op("piecewise_reads::from_getter", mutates_args=())
def from_getter(x: torch.Tensor) -> torch.Tensor:
    return x + get_context().offsets[: x.shape[0]]


@from_getter.register_fake
def _(x):
    return torch.empty_like(x)


class ReadsThroughGetter(torch.nn.Module):
    def forward(self, x):
        return torch.ops.piecewise_reads.from_getter(x)


def test_a_tensor_reached_through_a_getter_of_another_module_is_followed_into_that_module(monkeypatch):
    engine = get_context.__globals__
    engine["_context"] = types.SimpleNamespace(offsets=torch.randn(8, 4))
    reads = _watched(ReadsThroughGetter(), torch.randn(3, 4), monkeypatch)
    assert len(reads) == 1 and "held at `engine_context._context.offsets`" in str(reads[0]), [str(r) for r in reads]
    kept = engine["_context"]
    engine["_context"] = types.SimpleNamespace(offsets=torch.randn(8, 4))  # the next step's, the old one kept
    message = op_reads.stale(reads)
    assert message is not None and "`engine_context._context.offsets` now holds another tensor" in message, message
    engine["_context"] = kept
    assert op_reads.stale(reads) is None


REGISTRY: dict[str, torch.nn.Module] = {}


@torch.library.custom_op("piecewise_reads::update_by_name", mutates_args=())
def update_by_name(key: torch.Tensor, layer: str) -> torch.Tensor:
    REGISTRY[layer].cache.index_copy_(0, SLOTS["slots"][: key.shape[0]], key)  # vLLM's lookup of its layer by name
    return key.new_zeros(1)


@update_by_name.register_fake
def _(key, layer):
    return key.new_zeros(1)


class Registered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.cache = torch.zeros(32, 8)  # the model's own state, a plain attribute as vLLM's kv_cache
        REGISTRY["doctor.0"] = self

    def forward(self, x):
        key = self.proj(x)
        written = torch.ops.piecewise_reads.update_by_name(key, "doctor.0")
        return x + key * written.sum()


def test_the_doctor_names_a_custom_op_reading_per_call_metadata_from_a_global_and_where_it_is_held():
    SLOTS.update(slots=torch.arange(4))
    report = piecewise.doctor(Registered(), torch.randn(4, 8))
    found = [w for w in report.warnings if "piecewise_reads::update_by_name" in w]
    assert len(found) == 1, report.warnings  # the slot mapping; not the layer's own cache
    assert "held at `SLOTS['slots']`" in found[0] and "(32,) int64" not in found[0], found[0]
    assert "(4,) int64" in found[0] and "argument" in found[0] and "splitting op" in found[0], found[0]


@torch.library.custom_op("piecewise_reads::outer", mutates_args=())
def outer(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.piecewise_reads.inner(x * 2)  # hands on what it made: not an outside read


@outer.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("piecewise_reads::inner", mutates_args=())
def inner(x: torch.Tensor) -> torch.Tensor:
    return x + CONTEXT["nested"][: x.shape[0]]


@inner.register_fake
def _(x):
    return torch.empty_like(x)


class Nested(torch.nn.Module):
    def forward(self, x):
        return torch.ops.piecewise_reads.outer(x)


def test_a_custom_op_called_inside_another_is_watched_too(monkeypatch):
    CONTEXT.update(nested=torch.randn(8, 4))
    reads = _watched(Nested(), torch.randn(3, 4), monkeypatch)
    assert [r.op for r in reads] == ["piecewise_reads::inner"], [str(r) for r in reads]
    assert "held at `CONTEXT['nested']`" in str(reads[0])


def test_a_runner_whose_captured_op_read_a_tensor_now_replaced_runs_the_models_own_forward(monkeypatch):
    """The wiring of ``runtime/model.py`` (graphs are needed for the reads to be recorded: set here by hand, as a
    CUDA capture records them; tests/gpu/test_outside_tensors_gpu.py runs it with real graphs)."""
    CONTEXT.update(table=torch.randn(8, 4), split=torch.randn(8, 4))
    model = Reads()
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4], cache_dir=None))
    x = torch.randn(3, 4)
    with torch.no_grad():
        runner(x)
    runner.state.outside_reads = _watched(model, x, monkeypatch)
    CONTEXT["table"] = torch.randn(8, 4)  # the engine's next step
    monkeypatch.setattr(runner.state, "graphs_enabled", True)  # what a CUDA capture leaves
    with torch.no_grad(), pytest.warns(UserWarning, match=r"`piecewise_reads::from_context` at .* reads a \(8, 4\) "
                                                          r"float32 tensor \(held at `CONTEXT\['table'\]`\)"):
        torch.testing.assert_close(runner(x), model(x))
    assert runner.stats.eager_calls == 1


def test_dynamo_says_whether_its_pieces_call_a_custom_op_and_breakable_cannot_tell():
    """The captures are watched only where a custom op may run in them (a Python dispatch per op costs start-up)."""
    CONTEXT.update(table=torch.randn(8, 4), split=torch.randn(8, 4))
    x = torch.randn(3, 4)
    for model, calls in ((Reads(), True), (PureUnused(), True), (torch.nn.Linear(4, 4), False)):
        runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4], compiler="eager",
                                                                  frontend="dynamo", cache_dir=None))
        with torch.no_grad():
            runner(x)
        assert runner.frontend.runs_custom_ops() is calls, type(model).__name__
    runner = piecewise.compile(torch.nn.Linear(4, 4), piecewise.CaptureConfig(frontend="breakable", cache_dir=None))
    with torch.no_grad():
        runner(x)
    assert runner.frontend.runs_custom_ops() is True


@torch.library.custom_op("piecewise_reads::declared_write", mutates_args=("cache",))
def declared_write(rows: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> None:
    cache.index_copy_(0, positions, rows)


@declared_write.register_fake
def _(rows, positions, cache):
    return None


class DeclaredWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(32, 4))

    def forward(self, x, positions):
        h = self.linear(x)
        torch.ops.piecewise_reads.declared_write(h, positions, self.cache)  # Dynamo records the overload packet
        return h * 2


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_custom_op_declaring_its_cache_write_runs_between_the_pieces_on_the_real_rows(compiler):
    torch.manual_seed(0)
    model, eager = DeclaredWrite(), DeclaredWrite()
    eager.load_state_dict(model.state_dict())
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4], compiler=compiler,
                                                              frontend="dynamo", cache_dir=None))
    start = 0
    with torch.no_grad():
        for tokens in (3, 1, 4, 2):
            x, positions = torch.randn(tokens, 4), torch.arange(start, start + tokens)
            torch.testing.assert_close(runner(x, positions), eager(x, positions))
            torch.testing.assert_close(model.cache, eager.cache, msg=lambda m: f"after {tokens} tokens: {m}")
            start += tokens
    assert runner.stats.eager_writes == 1, runner.stats
