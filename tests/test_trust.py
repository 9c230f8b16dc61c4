"""Never silently wrong: what users of vLLM, SGLang, gpt-fast and transformers models do to a compiled model, each
right (equal to eager), refused with the reason, or warned about before a wrong number. Both front-ends, piecewise
and full graphs where they apply, sizes 1..max+1. On a CPU the pieces run padded, without graphs: what only graphs
get wrong (``.data`` swaps, attributes set between calls, side streams) is in ``gpu/test_trust_gpu.py``."""

from __future__ import annotations

import random
import threading
import warnings

import pytest
import torch
from torch import nn

import piecewise
from piecewise.errors import CaptureFailed, ForwardRefused

MAX = 8
SIZES = range(1, MAX + 2)
FRONTENDS = ["dynamo", "breakable", "auto"]


def config(frontend: str, **options) -> piecewise.CaptureConfig:
    return piecewise.CaptureConfig(max_tokens=MAX, frontend=frontend, **options)


def equal_at_every_size(model, runner, make, sizes=SIZES):
    """``make(tokens)`` → arguments; the runner's outputs equal the model's at each count (fresh copies of any cache
    for the model, the runner's own for it)."""
    for tokens in sizes:
        args = make(tokens)
        ours = runner(*args)
        with torch.no_grad():
            theirs = model(*[a.clone() if isinstance(a, torch.Tensor) and a.dim() > 1 else a for a in args])
        for got, want in zip(torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(theirs)):
            assert got.shape == want.shape, (tokens, got.shape, want.shape)
            torch.testing.assert_close(got, want, msg=lambda m: f"{tokens} tokens: {m}")


# --- an int token count handed to a splitting op (x.shape[0], 2 * x.shape[0]) --------------------------------------

@piecewise.opaque_op("test_trust::counted", split=True)
def counted(q: torch.Tensor, count: int, pairs: int) -> torch.Tensor:
    """Uses the counts it is given: wrong ones change the numbers."""
    assert count == q.shape[0] and pairs == 2 * q.shape[0], (count, pairs, q.shape)
    return q * count + pairs


class CountPassing(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Embedding(32, 8), nn.Linear(8, 8)

    def forward(self, ids):
        x = self.embed(ids)
        return self.out(counted(x, x.shape[0], 2 * x.shape[0]))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_splitting_op_given_the_token_count_as_an_int_gets_the_real_count(frontend):
    torch.manual_seed(0)
    model = CountPassing()
    runner = piecewise.compile(model, config(frontend))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        equal_at_every_size(model, runner, lambda t: (torch.randint(0, 32, (t,)),))


@piecewise.opaque_op("test_trust::bucketed", split=True)
def bucketed(q: torch.Tensor, blocks: int) -> torch.Tensor:
    return q * blocks


class BlockCount(nn.Module):
    """A number computed from the count that is not a whole multiple of it: ``(T + 3) // 4`` blocks."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, ids):
        x = self.embed(ids)
        return bucketed(x, (x.shape[0] + 3) // 4)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_number_computed_from_the_count_is_computed_from_the_real_count_or_refused_naming_the_op(frontend):
    """Dynamo's trace knows the expression (``(s0 + 3) // 4``) and evaluates it at the real count; breakable sees
    numbers only, and refuses one that is neither the count nor a whole multiple of it plus a constant, rather than
    give the op the padded size's."""
    torch.manual_seed(0)
    model = BlockCount()
    runner = piecewise.compile(model, config(frontend))
    if frontend == "breakable":
        with pytest.raises(ValueError, match=r"`test_trust::bucketed` is given \d+ at \d+ tokens .* changes with the "
                                             r"padded token count"):
            runner(torch.randint(0, 32, (6,)))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        equal_at_every_size(model, runner, lambda t: (torch.randint(0, 32, (t,)),))
    assert runner.stats["frontend"] == "dynamo"


# --- outputs: a fixed shape that equals a capture size; the tokens in dimension 1 ----------------------------------

class FixedAndTransposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 4)
        self.table = nn.Parameter(torch.randn(MAX, 4))  # [8, 4]: dimension 0 equals the top capture size

    def forward(self, ids):
        x = self.embed(ids)
        return x * 2, self.table * 1.0, x.T.contiguous()  # [T, 4], [8, 4], [4, T]


@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_outputs_are_cut_along_their_token_dimension_only(frontend, graph_mode):
    torch.manual_seed(0)
    model = FixedAndTransposed()
    runner = piecewise.compile(model, config(frontend, graph_mode=graph_mode))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # graph_mode="full" without capturable ops warns that nothing is full
        equal_at_every_size(model, runner, lambda t: (torch.randint(0, 32, (t,)),))


# --- argument kinds: dtypes, a static tensor viewed as another dtype ------------------------------------------------

class Positional(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(32, 8), nn.Embedding(64, 8)

    def forward(self, ids, positions, bias):
        scale = 2.0 if positions.dtype == torch.int32 else 1.0  # a model that looks at the dtype
        return (self.embed(ids) + self.pos(positions)) * scale + bias.float()


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_an_argument_of_another_dtype_runs_the_models_own_forward_with_one_warning(frontend):
    torch.manual_seed(0)
    model = Positional()
    runner = piecewise.compile(model, config(frontend))
    bias = torch.randn(8)
    ids = torch.randint(0, 32, (5,))
    runner(ids, torch.arange(5), bias)
    with pytest.warns(UserWarning, match=r"argument 'positions' has dtype torch.int32 and had torch.int64 at the first "
                                         r"call \(cast it: positions.to\(torch.int64\)"):
        out = runner(ids, torch.arange(5, dtype=torch.int32), bias)
    torch.testing.assert_close(out, model(ids, torch.arange(5, dtype=torch.int32), bias))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per difference
        torch.testing.assert_close(runner(ids, torch.arange(5, dtype=torch.int32), bias),
                                   model(ids, torch.arange(5, dtype=torch.int32), bias))
    halves = bias.view(torch.int32)  # the same memory, another dtype
    with pytest.warns(UserWarning, match=r"argument 'bias' has dtype torch.int32 and had torch.float32 at the first "
                                         r"call\. "):  # no cast suggested: the values would change
        out = runner(ids, torch.arange(5), halves)
    torch.testing.assert_close(out, model(ids, torch.arange(5), halves))
    assert runner.stats["eager_calls"] == 3


# --- weights updated after capture, as an RL rollout worker syncs them ----------------------------------------------

class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.first, self.second = nn.Embedding(32, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, ids):
        return self.second(self.first(self.embed(ids)).relu())


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_weights_synced_in_place_are_used_and_replaced_ones_refused(frontend):
    torch.manual_seed(0)
    model = TwoLayers()
    runner = piecewise.compile(model, config(frontend))
    runner(torch.randint(0, 32, (3,)))
    trained = TwoLayers().state_dict()
    model.load_state_dict(trained)  # copies into the same tensors
    equal_at_every_size(model, runner, lambda t: (torch.randint(0, 32, (t,)),))
    with torch.no_grad():
        model.second.weight.copy_(torch.randn(8, 8))
    equal_at_every_size(model, runner, lambda t: (torch.randint(0, 32, (t,)),))
    model.half()
    with pytest.raises(ValueError, match=r"parameter\(s\) or buffer\(s\) changed.*compile the model again"):
        runner(torch.randint(0, 32, (3,)))


# --- global state: autocast, the default dtype, train mode ----------------------------------------------------------

class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.linear, self.drop = nn.Embedding(32, 8), nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, ids):
        return self.drop(self.linear(self.embed(ids))) + torch.zeros(8, device=ids.device)  # in the default dtype


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_autocast_default_dtype_and_train_mode_changed_after_capture_run_eagerly(frontend):
    torch.manual_seed(0)
    model = Dropped().eval()
    runner = piecewise.compile(model, config(frontend))
    ids = torch.randint(0, 32, (5,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runner(ids)  # captured under autocast
    with pytest.warns(UserWarning, match=r"global state changed since the first call \(autocast"):
        out = runner(ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(ids))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            expected = model(ids)
        torch.testing.assert_close(runner(ids), expected)  # as captured: replayed
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning, match="default_dtype"):
            out = runner(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            expected = model(ids)
        assert out.dtype == expected.dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning, match="in train mode now"):
        torch.manual_seed(3)
        out = runner(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(3)
        with torch.no_grad():
            expected = model(ids)
    torch.testing.assert_close(out, expected)


# --- Python values the forward reads: random draws, counters -------------------------------------------------------

class PythonRandom(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, ids):
        return self.embed(ids) * random.random()


def test_a_python_random_draw_is_refused_by_breakable_naming_the_line():
    runner = piecewise.compile(PythonRandom(), config("breakable"))
    with pytest.raises(ForwardRefused, match=r"other values on another run of the same call.*random\.random\(\)") \
            as refused:
        runner(torch.randint(0, 32, (5,)))
    assert refused.value.kind == "frozen_value"


@pytest.mark.parametrize("frontend", ["dynamo", "auto"])
def test_a_python_random_draw_is_drawn_on_every_call_with_dynamo(frontend):
    """The draw is a graph break; the piece after it takes the number as an input and runs without its graph when it
    differs from the capture's (on a CPU: always without graphs). Each call equals eager drawing the same number,
    the first call included: its rehearsals put the generators back."""
    torch.manual_seed(0)
    model = PythonRandom()
    runner = piecewise.compile(model, config(frontend))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tokens in [3, *SIZES]:
            ids = torch.randint(0, 32, (tokens,))
            random.seed(tokens)
            ours = runner(ids)
            random.seed(tokens)
            torch.testing.assert_close(ours, model(ids))


class PositionCounter(nn.Module):
    """gpt-fast style position kept in Python: ``self.pos`` advanced by the forward."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos_embed, self.pos = nn.Embedding(32, 8), nn.Embedding(256, 8), 0

    def forward(self, ids):
        positions = torch.arange(self.pos, self.pos + ids.shape[0], device=ids.device)
        self.pos += ids.shape[0]
        return self.embed(ids) + self.pos_embed(positions)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_python_counter_is_refused_by_every_front_end_and_put_back(frontend):
    model = PositionCounter()
    runner = piecewise.compile(model, config(frontend))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ForwardRefused) as refused:
            runner(torch.randint(0, 32, (3,)))
    assert refused.value.kind in ("state_guard", "frozen_value")
    assert "mixes tokens" not in str(refused.value)
    assert "self.pos" in str(refused.value) or "arange" in str(refused.value)
    assert model.pos == 0  # the first call's rehearsals left no trace


# --- values read back to the host -----------------------------------------------------------------------------------

class ItemScale(nn.Module):
    """``x.abs().max().item()`` over the tokens: on a padded call the padding rows would count."""

    def __init__(self):
        super().__init__()
        self.embed, self.linear = nn.Embedding(32, 8), nn.Linear(8, 8)

    def forward(self, ids):
        x = self.linear(self.embed(ids))
        return x / x.abs().max().item()


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_float_read_back_from_the_token_rows_is_refused_everywhere_naming_the_line(frontend):
    runner = piecewise.compile(ItemScale(), config(frontend))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CaptureFailed, match=r"x\.abs\(\)\.max\(\)\.item\(\)") as refused:
            runner(torch.randint(0, 32, (7,)))
    assert "waits for the device" in str(refused.value)


@piecewise.opaque_op("test_trust::cache_write", mutates_args=("cache",), split=True)
def cache_write(k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> None:
    cache.index_copy_(0, positions, k)


class PlainAttention(nn.Module):
    """Attention in plain Python, sized on the host by ``int(positions.max())`` (not a splitting op)."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv = nn.Embedding(32, 8), nn.Linear(8, 24)

    def forward(self, ids, positions, cache):
        q, k, v = self.qkv(self.embed(ids)).chunk(3, -1)
        cache_write(k, positions, cache)
        end = int(positions.max()) + 1
        later = torch.arange(end, device=ids.device)[None] > positions[:, None]
        scores = (q @ cache[:end].T).masked_fill(later, float("-inf"))
        return scores.softmax(-1) @ cache[:end]


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_plain_python_attention_that_sizes_on_the_host_is_right_or_refused_never_nan(frontend):
    torch.manual_seed(0)
    model = PlainAttention()
    runner = piecewise.compile(model, config(frontend))
    cache, theirs = torch.zeros(32, 8), torch.zeros(32, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for tokens in SIZES:
                positions = torch.arange(tokens) + 3
                ids = torch.randint(0, 32, (tokens,))
                got = runner(ids, positions, cache)
                with torch.no_grad():
                    torch.testing.assert_close(got, model(ids, positions, theirs))
        except (CaptureFailed, ForwardRefused) as refused:
            assert frontend != "breakable", "breakable reads integer metadata outside a capture"
            assert "int(positions.max())" in str(refused)


# --- branches on the token count ------------------------------------------------------------------------------------

class DecodePath(nn.Module):
    """One path for a decode step (one token), another for a prefill: the ladder's 1 and 2 bound it exactly."""

    def __init__(self):
        super().__init__()
        self.embed, self.linear = nn.Embedding(32, 8), nn.Linear(8, 8)

    def forward(self, ids):
        x = self.embed(ids)
        if ids.shape[0] == 1:
            return self.linear(x) * 3
        return self.linear(x)


class Threshold(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, ids):
        x = self.embed(ids)
        if ids.shape[0] > 5:
            x = x * 1.5
        return x


@pytest.mark.parametrize("frontend", ["breakable", "auto"])
def test_a_branch_the_ladder_bounds_exactly_is_served_right(frontend):
    torch.manual_seed(0)
    model = DecodePath()
    runner = piecewise.compile(model, config(frontend))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto: Dynamo refuses the branch and says so
        equal_at_every_size(model, runner, lambda t: (torch.randint(0, 32, (t,)),))
    assert runner.stats["frontend"] == "breakable"


@pytest.mark.parametrize("first", [1, 7])
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_branch_between_capture_sizes_gets_one_refusal_naming_the_line_and_the_doctor_agrees(frontend, first):
    runner = piecewise.compile(Threshold(), config(frontend))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ForwardRefused, match=r"(if ids\.shape\[0\] > 5|x = x \* 1\.5)") as refused:
            runner(torch.randint(0, 32, (first,)))
    assert refused.value.kind == "token_branch"
    assert "frontend='breakable' runs the branch per size" not in str(refused.value)
    report = piecewise.doctor(Threshold(), torch.randint(0, 32, (first,)))
    assert "token_branch" in [blocker.kind for blocker in report.blockers]
    assert report.recommended[0] is None


# --- threads --------------------------------------------------------------------------------------------------------

@piecewise.opaque_op("test_trust::seen_tokens", split=True)
def seen_tokens(x: torch.Tensor) -> torch.Tensor:
    ctx = piecewise.context()  # None when the model runs eagerly, outside piecewise
    assert ctx is None or ctx.num_tokens == x.shape[0], (ctx, x.shape)
    return x + x.shape[0]


class Seen(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, ids):
        return seen_tokens(self.embed(ids))


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_runners_in_two_threads_each_see_their_own_call(frontend):
    """One thread makes its runner's first call while another serves its own: each splitting op sees its own
    call's context, and every output equals eager."""
    torch.manual_seed(0)
    models = [Seen(), Seen()]
    runners = [piecewise.compile(m, config(frontend)) for m in models]
    runners[1](torch.randint(0, 32, (3,)))  # the second one is serving already
    failures = []

    def work(index: int) -> None:
        try:
            for step in range(12):
                tokens = 1 + (step * (index + 3)) % (MAX + 1)
                ids = torch.randint(0, 32, (tokens,))
                torch.testing.assert_close(runners[index](ids), models[index](ids))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(index,)) for index in (0, 1)]
    with torch.no_grad():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not failures, failures


# --- a position table smaller than the top capture size (GPT-2's wpe) ----------------------------------------------

class LearnedPositions(nn.Module):
    def __init__(self, table: int = 6):
        super().__init__()
        self.embed, self.wpe = nn.Embedding(32, 8), nn.Embedding(table, 8)

    def forward(self, ids):
        return self.embed(ids) + self.wpe(torch.arange(ids.shape[0], device=ids.device))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_sizes_whose_padding_indexes_past_a_table_are_left_out_and_calls_above_run_as_the_model_does(frontend):
    torch.manual_seed(0)
    model = LearnedPositions(table=6)
    runner = piecewise.compile(model, config(frontend))
    with pytest.warns(UserWarning, match=r"padded to 8 tokens the forward's `embedding` at .*self\.wpe\(torch\.arange"
                                         r".*Sizes above 4 are not captured"):
        runner(torch.randint(0, 32, (3,)))
    assert runner.stats["capture_sizes"] == [1, 2, 4]
    equal_at_every_size(model, runner, lambda t: (torch.randint(0, 32, (t,)),), sizes=range(1, 7))
    with pytest.raises(IndexError):  # the model's own limit, as eagerly
        runner(torch.randint(0, 32, (7,)))


# --- transformers: a TokenModel whose attention was not enabled -----------------------------------------------------

def test_a_token_model_given_a_cache_without_enable_is_refused():
    transformers = pytest.importorskip("transformers")
    from piecewise.integrations.transformers import TokenModel

    config_ = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config_).eval()
    token_model = TokenModel(model)
    cache = torch.zeros(1, 2, 16, 1, 8)
    with pytest.raises(ValueError, match=r"call piecewise.integrations.transformers.enable\(model\)"):
        token_model(torch.randint(0, 64, (3,)), torch.arange(3), cache)


# --- attention metadata passed as an object (SGLang's forward batch, vLLM's metadata) -----------------------------

class Metadata:
    def __init__(self, positions: torch.Tensor, scale: float):
        self.positions, self.scale = positions, scale


@piecewise.opaque_op("test_trust::shifted", split=True)
def shifted(x: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale + positions[:, None].to(x.dtype)


class WithMetadataArgument(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, ids, meta):
        return shifted(self.embed(ids), meta.positions[: ids.shape[0]], meta.scale)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_metadata_object_updated_in_place_is_right_and_a_new_one_over_the_same_buffers_replays(frontend):
    """Breakable replays read what the object held at capture: an object whose fields changed (in place, or a new
    one) runs the model's own forward with one warning; one holding the same buffers and values replays. Dynamo
    reads the fields again on every call."""
    torch.manual_seed(0)
    model = WithMetadataArgument()
    runner = piecewise.compile(model, config(frontend), dynamic={"ids": 0})
    buffer = torch.arange(MAX + 1)
    meta = Metadata(buffer, 1.0)
    ids = torch.randint(0, 32, (5,))
    runner(ids, meta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = Metadata(buffer, 1.0)  # a new object over the same buffer: nothing the graphs read changed
        torch.testing.assert_close(runner(ids, same), model(ids, same))
        buffer.add_(3)  # the buffer's contents, in place: read at replay
        torch.testing.assert_close(runner(ids, meta), model(ids, meta))
    meta.scale = 2.0  # a field, in place
    meta.positions = torch.arange(MAX + 1) * 2  # another tensor
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(runner(ids, meta), model(ids, meta))
    ours = [str(w.message) for w in caught if "piecewise" in str(w.message)]
    if frontend == "breakable":
        assert len(ours) == 1 and "argument 'meta' holds other values than at the first call" in ours[0]


def test_a_metadata_object_holding_a_new_tensor_of_equal_values_is_told_so():
    """Breakable's warning says a field holds another tensor (not "other values") where only the tensor object is
    new: the values may be equal, the graphs read the old one's memory."""
    model = WithMetadataArgument()
    runner = piecewise.compile(model, config("breakable"), dynamic={"ids": 0})
    ids = torch.randint(0, 32, (5,))
    runner(ids, Metadata(torch.arange(MAX + 1), 1.0))
    fresh = Metadata(torch.arange(MAX + 1), 1.0)  # equal values, a new tensor
    with pytest.warns(UserWarning, match=r"argument 'meta' holds another tensor in field `positions` than at the "
                                         r"first call \(the same shape and dtype at another address\)"):
        torch.testing.assert_close(runner(ids, fresh), model(ids, fresh))


def test_front_end_and_compiler_names_are_listed_once_and_the_registries_hold_exactly_those():
    from piecewise.capture.compilers import COMPILERS
    from piecewise.config import COMPILERS as COMPILER_NAMES
    from piecewise.config import FRONTENDS as FRONTEND_NAMES
    from piecewise.frontends import REGISTRY

    assert set(REGISTRY) == set(FRONTEND_NAMES) - {"auto"} and set(COMPILERS) == set(COMPILER_NAMES)


class WeightItem(nn.Module):
    """A host read of a weight (not of the tokens) in forward: illegal while a graph captures, on every device."""

    def __init__(self):
        super().__init__()
        self.embed, self.linear = nn.Embedding(32, 8), nn.Linear(8, 8)

    def forward(self, ids):
        scale = self.linear.weight.abs().max().item()
        return self.linear(self.embed(ids)) / scale


def test_the_doctor_and_compile_give_one_answer_on_a_weights_item():
    model = WeightItem()
    report = piecewise.doctor(model, torch.randint(0, 32, (5,)))
    runner = piecewise.compile(model, config("auto"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CaptureFailed, match=r"self\.linear\.weight\.abs\(\)\.max\(\)\.item\(\)"):
            runner(torch.randint(0, 32, (5,)))
    assert not report.ok and report.recommended[0] is None
    assert any("item" in blocker.message for blocker in report.blockers)


def test_a_branch_on_the_token_count_after_the_rope_tables_is_blamed_on_its_own_line():
    from piecewise.models import example
    from piecewise.models.llama import TinyLlama, rotary_tables

    class Branchy(TinyLlama):
        def forward(self, input_ids, positions, kv_cache):
            x = self.embed(input_ids)
            rotary = rotary_tables(positions, self.config.head_dim, self.config.rope_theta)
            if input_ids.shape[0] > 5:  # the line to name
                x = x * 1.5
            for layer in self.layers:
                x = layer(x, positions, kv_cache, rotary)
            return self.lm_head(self.norm(x))

    model, (ids, positions, cache) = example(tokens=3, model_class=Branchy)
    for frontend in FRONTENDS:
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ForwardRefused, match=r"(if input_ids\.shape\[0\] > 5|x = x \* 1\.5)") as refused:
                runner(ids, positions, cache.clone())
        assert "rotary" not in str(refused.value).split("piecewise:")[1].split(".")[0]


def test_a_static_argument_of_another_dtype_is_named_as_such_not_as_moved_storage():
    from piecewise.models import example

    model, (ids, positions, cache) = example(tokens=5, num_layers=1)
    runner = piecewise.compile(model, config("auto"))
    runner(ids, positions, cache)
    with pytest.raises(ValueError, match=r"static argument 'kv_cache' is not the tensor seen at capture \(it has dtype "
                                         r"torch.float64 and had torch.float32: a converted copy is another tensor\)"):
        runner(ids, positions, cache.double())
    with pytest.raises(ValueError, match=r"\(it has device meta and had cpu: a converted copy is another tensor\)"):
        runner(ids, positions, cache.to("meta"))
    with pytest.raises(ValueError, match=r"\(its storage moved\)"):
        runner(ids, positions, cache.clone())


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_forward_hooks_are_named_at_the_first_call(frontend):
    """A hook keeping activations sees padded rows, and replays run no Python (breakable) or keep graph memory
    (Dynamo): the first call names each hook; the model's output, hook-changed included, stays right."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).eval()
    kept = {}

    def keep_activation(module, args, output):
        kept["hidden"] = output

    model[0].register_forward_hook(keep_activation)
    model[2].register_forward_hook(lambda module, args, output: output * 2)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    x = torch.randn(3, 8)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"Python forward hooks \(0: .*keep_activation; 2: .*"
                                                          r"<lambda>\)\. A hook that changes") as caught:
        torch.testing.assert_close(runner(x), model(x))
    assert [w.filename for w in caught if "forward hooks" in str(w.message)] == [__file__]  # the caller's line
    plain = piecewise.compile(torch.nn.Linear(8, 8), piecewise.CaptureConfig(max_tokens=8, cache_dir=None))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain(x)
    assert not [w for w in caught if "forward hooks" in str(w.message)]
