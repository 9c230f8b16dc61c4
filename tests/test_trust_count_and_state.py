"""Forwards that read the token count as a value, model state changed after the first call, tensors kept in module
attributes: refused, served by the model's own forward, or named in a warning; never silently wrong."""

import dataclasses
import re
import warnings

import pytest
import torch

import piecewise
from piecewise.errors import ForwardRefused
from piecewise.models.llama import LlamaConfig, TinyLlama

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, max_seq_len=64)


def _config(frontend: str, **extra) -> piecewise.CaptureConfig:
    return piecewise.CaptureConfig(max_tokens=16, frontend=frontend, compiler="eager", cache_dir=None, **extra)


def _breakable(model_class):
    """A model of ``model_class``, its breakable runner, a cache for each and 64 token ids."""
    torch.manual_seed(0)
    model = model_class(CONFIG).eval()
    return (model, piecewise.compile(model, _config("breakable")), model.make_kv_cache(), model.make_kv_cache(),
            torch.randint(0, 64, (64,)))


class LastRowMask(TinyLlama):
    """Keeps only the last row's logits with a mask made from the count (a static-shape ``logits_to_keep=1``)."""

    def forward(self, input_ids, positions, kv_cache):
        logits = super().forward(input_ids, positions, kv_cache)
        tokens = input_ids.shape[0]
        return logits * (torch.arange(tokens) == tokens - 1)[:, None]


class CapacityMoE(torch.nn.Module):
    """Top-1 routing with an expert capacity computed from the count (GShard, DeepSpeed-MoE): tokens past an
    expert's capacity are dropped."""

    def __init__(self, width: int = 16, experts: int = 4):
        super().__init__()
        self.router = torch.nn.Linear(width, experts)
        self.experts = torch.nn.Parameter(torch.randn(experts, width, width) / width ** 0.5)

    def forward(self, x):
        tokens, experts = x.shape[0], self.experts.shape[0]
        choice = self.router(x).argmax(-1)
        capacity = (tokens + experts - 1) // experts  # capacity factor 1
        one_hot = torch.nn.functional.one_hot(choice, experts)
        rank = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # place of each token in its expert's queue
        kept = (rank < capacity).to(x.dtype)[:, None]
        return torch.einsum("td,tdo->to", x, self.experts[choice]) * kept


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("graph_mode", ["piecewise", None])
def test_a_mask_of_the_last_row_made_from_the_count_is_refused(frontend, graph_mode):
    """Padded, the mask marks a pad row: the real rows all get zeros. Comparing padded runs with each other does
    not see it (the real rows' mask is the same at every padded size); the run at the call's own count does."""
    torch.manual_seed(0)
    model = LastRowMask(CONFIG).eval()
    runner = piecewise.compile(model, _config(frontend, graph_mode=graph_mode))
    cache = model.make_kv_cache()
    with torch.no_grad(), pytest.raises(ForwardRefused, match=r"takes the token count for a value.*between the call "
                                                               r"run as it is and padding to \d+ tokens") as refused:
        runner(torch.randint(0, 64, (9,)), torch.arange(9), cache)
    assert refused.value.kind == "token_mixing"


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_an_expert_capacity_computed_from_the_count_is_refused(frontend):
    torch.manual_seed(0)
    model = CapacityMoE().eval()
    runner = piecewise.compile(model, _config(frontend))
    x = torch.randn(9, 16)
    with torch.no_grad():
        eager = model(x)
        assert (eager.abs().sum(-1) == 0).any(), "no token was dropped at 9 tokens: nothing to test"
        with pytest.raises(ForwardRefused, match="takes the token count for a value"):
            runner(x)


class KeptCount(torch.nn.Module):
    """Keeps the call's token count in a buffer (a cache length, a step size) that the next call reads."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("kept", torch.zeros((), dtype=dtype))

    def forward(self, x):
        out = self.lin(x) * (1 + self.kept.float() / 10)
        self.kept.fill_(x.shape[0])
        return out


@pytest.mark.parametrize("frontend", ["dynamo", "breakable", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.int32])
def test_a_count_kept_in_a_buffer_of_any_dtype_is_refused_or_exact(frontend, dtype):
    """Padded, ``fill_(x.shape[0])`` keeps the padded count. An integer count (the natural dtype of a length) went
    unchecked by breakable: the buffer held 8 after a call of 5 tokens, and the next call's output was off."""
    torch.manual_seed(0)
    model, twin = KeptCount(dtype).eval(), KeptCount(dtype).eval()
    twin.load_state_dict(model.state_dict())
    runner = piecewise.compile(model, _config(frontend))
    with torch.no_grad():
        for index, tokens in enumerate((5, 3, 7, 2)):
            x = torch.randn(tokens, 8)
            try:
                out = runner(x)
            except ForwardRefused as refused:
                assert index == 0 and refused.kind == "token_mixing", refused
                assert "buffer `kept`" in str(refused) and "buf.fill_(x.shape[0])" in str(refused)
                return
            torch.testing.assert_close(out, twin(x), msg=f"call {index} ({tokens} tokens)")
            assert model.kept.item() == twin.kept.item() == tokens
    assert frontend != "breakable", "breakable served a count it pads"


class TokenShift(torch.nn.Module):
    """State read, then overwritten, in plain code: each slot's previous row added to its new one."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("rows", torch.randn(16, 8))

    def forward(self, x, slots):
        h = self.lin(x)
        previous = self.rows[slots]
        self.rows[slots] = h
        return h + previous


@pytest.mark.parametrize("frontend", ["dynamo", "breakable", "auto"])
def test_state_read_then_overwritten_gives_the_first_call_what_it_held_before(frontend):
    """The first call's rehearsals write the rows before its own run reads them; Dynamo's first output read its
    own rows (2.9 off) until every tensor each run writes was put back before the call."""
    torch.manual_seed(0)
    model, twin = TokenShift().eval(), TokenShift().eval()
    twin.load_state_dict(model.state_dict())
    runner = piecewise.compile(model, _config(frontend))
    with torch.no_grad():
        for tokens, start in ((5, 0), (3, 5), (2, 8)):
            x, slots = torch.randn(tokens, 8), torch.arange(start, start + tokens)
            torch.testing.assert_close(runner(x, slots), twin(x, slots), msg=f"{tokens} tokens at {start}")
    torch.testing.assert_close(model.rows, twin.rows)


class Flagged(TinyLlama):
    """A flag set on the model between calls (``last_only``: an engine asks for the last token's logits only)."""

    last_only = False

    def forward(self, input_ids, positions, kv_cache):
        logits = super().forward(input_ids, positions, kv_cache)
        return logits[-1:] if self.last_only else logits


def _calls(model, runner, counts, flip_at):
    cache, reference = model.make_kv_cache(), model.make_kv_cache()
    ids, start = torch.randint(0, 64, (64,)), 0
    for index, tokens in enumerate(counts):
        if index == flip_at:
            model.last_only = True
        positions = torch.arange(start, start + tokens)
        out = runner(ids[start:start + tokens], positions, cache)
        with torch.inference_mode():
            want = model(ids[start:start + tokens], positions, reference)
        torch.testing.assert_close(out, want, msg=f"call {index} ({tokens} tokens)")
        start += tokens
    torch.testing.assert_close(cache, reference)


@pytest.mark.parametrize("graph_mode", ["piecewise", None])
def test_a_flag_flipped_after_the_first_call_runs_the_models_own_forward_under_dynamo(graph_mode):
    """The flag fails a guard of the first call's trace: a full graph (whose replay runs no Dynamo code) and the
    trace Dynamo makes for the new state (whose padding no check saw: ``logits[-1:]`` would be a pad row) both hand
    such calls to the model's own forward, with one warning."""
    torch.manual_seed(0)
    model = Flagged(CONFIG).eval()
    runner = piecewise.compile(model, _config("dynamo", graph_mode=graph_mode))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _calls(model, runner, [5, 1, 3, 5, 2, 7], flip_at=2)
    messages = [str(w.message) for w in caught if "piecewise" in str(w.message)]
    assert len(messages) == 1 and "model's own forward" in messages[0], messages
    assert runner.stats["eager_calls"] >= 3  # a call of exactly a capture size may run the new trace: not padded


def test_a_class_default_flag_assigned_after_the_first_call_is_refused_by_breakable():
    """Breakable replays no Python: an attribute its forward read (here the class's default, ``last_only =
    False``, overridden on the instance) and that is assigned afterwards is named before any graph or padded run
    serves a call."""
    torch.manual_seed(0)
    model = Flagged(CONFIG).eval()
    runner = piecewise.compile(model, _config("breakable"))
    with torch.no_grad(), pytest.raises(ValueError, match=r"`last_only` was assigned after the first call, and the "
                                                          r"forward reads it at .*if self.last_only"):
        _calls(model, runner, [5, 1, 3], flip_at=2)


def test_a_method_patched_on_an_instance_after_the_first_call_is_refused_by_breakable():
    """``layer.post_attention = patched`` after the first call: breakable's replays would go on running the
    method of the capture (on a GPU its graphs served the old method, 0.74 off). Named with the line that calls
    it; Dynamo's guards see it and run the model's own forward."""
    torch.manual_seed(0)
    model = TinyLlama(CONFIG).eval()
    runner = piecewise.compile(model, _config("breakable"))
    cache = model.make_kv_cache()
    with torch.no_grad():
        runner(torch.randint(0, CONFIG.vocab_size, (5,)), torch.arange(5), cache)
        model.layers[0].post_attention = lambda x, attended: x
        with pytest.raises(ValueError, match=r"`layers\.0\.post_attention` was assigned after the first call, and "
                                             r"the forward reads it at .*self\.post_attention\("):
            runner(torch.randint(0, CONFIG.vocab_size, (3,)), torch.arange(5, 8), cache)


class Patchable(TinyLlama):
    """A subclass of its own, so that patching its layers' class leaves other tests' classes alone."""


@pytest.mark.parametrize("change", ["class_forward", "del_layer", "insert_layer", "reorder_layers"])
@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_class_forward_patched_or_layers_deleted_after_the_first_call_are_refused(frontend, change):
    """``Layer.forward = patched`` (a class, not the instance: no attribute of the model changes) or ``del
    model.layers[1]`` / ``insert`` after the first call: the trace and the graphs would go on with the old code and
    layers (Dynamo's guards missed the class patch: 0.67 off on a CPU). Refused, naming the class or container."""
    torch.manual_seed(0)
    model = Patchable(CONFIG).eval()
    layer_class = type("PatchableLayer", (type(model.layers[0]),), {})
    for layer in model.layers:
        layer.__class__ = layer_class
    runner = piecewise.compile(model, _config(frontend))
    cache = model.make_kv_cache()
    with torch.no_grad():
        runner(torch.randint(0, CONFIG.vocab_size, (5,)), torch.arange(5), cache)
        if change == "class_forward":
            layer_class.forward = lambda self, x, *args: x
            match = r"`PatchableLayer\.forward` was patched after the first call"
        elif change == "del_layer":
            del model.layers[1]
            match = r"`layers` had 2 layers at the first call and has 1 now"
        elif change == "insert_layer":
            model.layers.insert(0, model.layers[1])
            match = r"`layers` had 2 layers at the first call and has 3 now"
        else:  # the same dict, the same length, no registration hook: breakable's replays kept the old order
            modules = model.layers._modules
            modules["0"], modules["1"] = modules["1"], modules["0"]
            match = r"the layers of `layers` were replaced or reordered"
        with pytest.raises(ValueError, match=match + r".*compile the model again"):
            runner(torch.randint(0, CONFIG.vocab_size, (3,)), torch.arange(5, 8), cache)


class Lengths:
    """Attention metadata as engines pass it: a Python length that changes every step."""

    def __init__(self, max_len: int):
        self.max_len = max_len


class ReadsLength(TinyLlama):
    def forward(self, input_ids, positions, kv_cache, meta):
        logits = super().forward(input_ids, positions, kv_cache)
        return logits * (positions < meta.max_len - 1)[:, None]  # read in plain code, not inside a splitting op


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_python_length_in_a_metadata_object_that_changes_every_step_is_named_and_served_eagerly(frontend):
    """The graphs hold the first call's length: later steps run the model's own forward (equal to eager), and the
    one warning names the value (Dynamo: its guard and the model line) and says how to pass such a value."""
    torch.manual_seed(0)
    model = ReadsLength(CONFIG).eval()
    runner = piecewise.compile(model, _config(frontend))
    cache, reference = model.make_kv_cache(), model.make_kv_cache()
    ids, start = torch.randint(0, 64, (64,)), 0
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens in [5, 1, 1, 3, 1]:
            positions = torch.arange(start, start + tokens)
            out = runner(ids[start:start + tokens], positions, cache, Lengths(start + tokens))
            with torch.inference_mode():
                want = model(ids[start:start + tokens], positions, reference, Lengths(start + tokens))
            torch.testing.assert_close(out, want)
            start += tokens
    torch.testing.assert_close(cache, reference)
    messages = [str(w.message) for w in caught if "piecewise" in str(w.message)]
    assert len(messages) == 1, messages
    named = r"L\['meta'\]\.max_len == 5, .*test_trust_count_and_state.py:\d+ in forward" if frontend == "dynamo" \
        else r"argument 'meta' holds other values than at the first call \(field `max_len`\)"
    assert re.search(named, messages[0]), messages[0]
    assert "must reach the forward as a tensor, or be read only inside a splitting op" in messages[0]


class StartsAtZero(TinyLlama):
    """Reduces over the positions (a chunk's start; "is this a prefill"): a first call from position 0 holds what a
    zero pad row holds, so only rows without the first show that the padding changes it."""

    kind = "min"

    def forward(self, input_ids, positions, kv_cache):
        logits = super().forward(input_ids, positions, kv_cache)
        if self.kind == "min":
            return logits + positions.min()
        return logits * (1.0 + (positions == 0).any())


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("kind,tokens", [("min", 5), ("min", 2), ("any", 3)])
def test_a_reduction_over_the_positions_is_refused_though_the_first_call_starts_at_zero(frontend, kind, tokens):
    torch.manual_seed(0)
    model = StartsAtZero(CONFIG).eval()
    model.kind = kind
    runner = piecewise.compile(model, _config(frontend))
    with torch.no_grad(), pytest.raises(ForwardRefused, match="mixes tokens") as refused:
        runner(torch.randint(0, 64, (tokens,)), torch.arange(tokens), model.make_kv_cache())
    assert refused.value.kind == "token_mixing"


@dataclasses.dataclass(frozen=True)
class FrozenSettings:
    scale: float = 2.0


def test_a_frozen_settings_object_is_watched_without_being_assigned_to():
    torch.manual_seed(0)
    model = ReadsSetting(CONFIG, FrozenSettings()).eval()
    runner = piecewise.compile(model, _config("breakable"))
    cache, reference = model.make_kv_cache(), model.make_kv_cache()
    with torch.no_grad():
        for start, stop in ((0, 5), (5, 8)):
            out = runner(torch.arange(start, stop), torch.arange(start, stop), cache)
            torch.testing.assert_close(out, model(torch.arange(start, stop), torch.arange(start, stop), reference))
    assert type(model.settings) is FrozenSettings


class Settings:
    """A model's settings object, as transformers' ``config``: fields the forward reads."""

    def __init__(self):
        self.scale = 1.0


class ReadsSetting(TinyLlama):
    def __init__(self, config, settings=None):
        super().__init__(config)
        self.settings = settings or Settings()

    def forward(self, input_ids, positions, kv_cache):
        return super().forward(input_ids, positions, kv_cache) * self.settings.scale


def test_a_settings_field_changed_after_the_first_call_is_refused_by_breakable_and_followed_by_dynamo():
    """Breakable replays no Python: a field of the module's settings object the forward read (``config.window``)
    and changed afterwards is named; Dynamo's guard on it fails and the model's own forward serves the call."""
    for frontend in ("breakable", "dynamo"):
        torch.manual_seed(0)
        model = ReadsSetting(CONFIG).eval()
        runner = piecewise.compile(model, _config(frontend))
        cache, reference = model.make_kv_cache(), model.make_kv_cache()
        ids = torch.randint(0, 64, (9,))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner(ids[:5], torch.arange(5), cache)
            model(ids[:5], torch.arange(5), reference)
            model.settings.scale = 3.0
            refusal = r"`settings.scale` changed after the first call, and the forward reads it at .*self.settings.scale"
            _refused_or_equal(runner, model, ids, (5, 8), cache, reference, refusal if frontend == "breakable" else None)


class GrowsRotary(TinyLlama):
    """Takes the sequence length as a Python int, HF's older rotary style: a new value at every call."""

    def forward(self, input_ids, positions, kv_cache, seq_len):
        return super().forward(input_ids, positions, kv_cache) * (1.0 + 0.0 * seq_len)


def test_a_python_number_argument_that_changes_every_call_warns_once():
    model, runner, cache, reference, ids = _breakable(GrowsRotary)
    start = 0
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens in [5, 1, 1, 2]:
            positions = torch.arange(start, start + tokens)
            out = runner(ids[start:start + tokens], positions, cache, start + tokens)
            torch.testing.assert_close(out, model(ids[start:start + tokens], positions, reference, start + tokens))
            start += tokens
    messages = [str(w.message) for w in caught if "piecewise" in str(w.message)]
    assert len(messages) == 1 and "argument 'seq_len' is 6 and was 5" in messages[0], messages
    assert runner.stats["eager_calls"] == 3


class KeepsHidden(TinyLlama):
    def forward(self, input_ids, positions, kv_cache):
        logits = super().forward(input_ids, positions, kv_cache)
        self.last_logits = logits  # read after the call, as a drafter reads the target's hidden states
        return logits


def test_a_tensor_kept_in_a_module_attribute_is_named_in_a_warning_under_dynamo():
    torch.manual_seed(0)
    model = KeepsHidden(CONFIG).eval()
    runner = piecewise.compile(model, _config("dynamo"))
    with torch.no_grad(), pytest.warns(UserWarning, match=r"keeps a tensor it makes in `self.last_logits`.*padding "
                                                          r"rows.*Return it from forward"):
        runner(torch.randint(0, 64, (5,)), torch.arange(5), model.make_kv_cache())


class StepMeta:
    """Engine-side per-step metadata the model holds, read only inside a splitting op (which runs on every call)."""

    def __init__(self):
        self.temperature = 1.0


STEP = StepMeta()


@piecewise.opaque_op("test_trust_count_and_state::scale_rows", split=True)
def scale_rows(x: torch.Tensor) -> torch.Tensor:
    return x / STEP.temperature


class ScalesInAnOp(TinyLlama):
    def __init__(self, config):
        super().__init__(config)
        self.meta = STEP

    def forward(self, input_ids, positions, kv_cache):
        return torch.ops.test_trust_count_and_state.scale_rows(super().forward(input_ids, positions, kv_cache))


def test_a_settings_field_read_only_inside_a_splitting_op_may_change_between_calls():
    model, runner, cache, reference, ids = _breakable(ScalesInAnOp)
    start = 0
    with torch.no_grad():
        for tokens, temperature in [(5, 1.0), (3, 2.0), (2, 0.5)]:
            STEP.temperature = temperature
            out = runner(ids[start:start + tokens], torch.arange(start, start + tokens), cache)
            want = model(ids[start:start + tokens], torch.arange(start, start + tokens), reference)
            torch.testing.assert_close(out, want)
            start += tokens
    STEP.temperature = 1.0


class EngineContext:
    """vLLM's forward context: an engine fills a global object before each step."""

    use_lora = False
    scale = 1.0


ENGINE = EngineContext()


@piecewise.opaque_op("trust_state::scaled_by_context", split=True)
def scaled_by_context(x: torch.Tensor) -> torch.Tensor:
    return x * ENGINE.scale  # a splitting op runs on every call: its reads are read anew


class ReadsGlobals(TinyLlama):
    def __init__(self, config, inside_op: bool):
        super().__init__(config)
        self.inside_op = inside_op

    def forward(self, input_ids, positions, kv_cache):
        logits = super().forward(input_ids, positions, kv_cache)
        if self.inside_op:
            return scaled_by_context(logits)
        if ENGINE.use_lora:  # Python values of a global object, read in plain code
            logits = logits + 1.0
        return logits * ENGINE.scale


@pytest.mark.parametrize("inside_op,changed", [(False, "use_lora"), (False, "scale"), (True, "scale")])
def test_a_global_objects_value_read_in_plain_code_and_changed_after_the_first_call_is_refused_by_breakable(
        inside_op, changed):
    """Breakable's replays run no Python: a flag or number the forward reads from a global object (an engine's
    forward context) and that changes afterwards is named with its line (on a GPU the graphs kept the first
    call's branch and scale: 16.6 off). Unchanged, calls are served; read inside a splitting op, it is read anew."""
    torch.manual_seed(0)
    model = ReadsGlobals(CONFIG, inside_op).eval()
    runner = piecewise.compile(model, _config("breakable"))
    cache, reference = model.make_kv_cache(), model.make_kv_cache()
    ids = torch.randint(0, 64, (12,))
    try:
        with torch.no_grad():
            for start, stop in ((0, 5), (5, 7)):
                out = runner(ids[start:stop], torch.arange(start, stop), cache)
                torch.testing.assert_close(out, model(ids[start:stop], torch.arange(start, stop), reference))
            setattr(ENGINE, changed, {"use_lora": True, "scale": 2.0}[changed])  # scale: read mid-line
            refusal = rf"the global `ENGINE\.{changed}` changed after the first call, and the forward reads it at " \
                      rf".*{'if ENGINE.use_lora' if changed == 'use_lora' else 'return logits [*] ENGINE.scale'}"
            _refused_or_equal(runner, model, ids, (7, 9), cache, reference, None if inside_op else refusal)
    finally:
        ENGINE.use_lora, ENGINE.scale = False, 1.0


def _refused_or_equal(runner, model, ids, span, cache, reference, refusal: str | None) -> None:
    """The call of ``ids[span]`` refused with ``refusal``, or (None) equal to the model's own, caches too."""
    start, stop = span
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            runner(ids[start:stop], torch.arange(start, stop), cache)
        return
    torch.testing.assert_close(runner(ids[start:stop], torch.arange(start, stop), cache),
                               model(ids[start:stop], torch.arange(start, stop), reference))
    torch.testing.assert_close(cache, reference)


CALLS = 0


class CountsCalls(TinyLlama):
    def forward(self, input_ids, positions, kv_cache):
        global CALLS
        CALLS += 1  # the forward's own global state: it changes at each run of the first call
        return super().forward(input_ids, positions, kv_cache)


def test_a_global_the_forward_sets_itself_is_not_taken_for_a_change_after_the_first_call():
    torch.manual_seed(0)
    model = CountsCalls(CONFIG).eval()
    runner = piecewise.compile(model, _config("breakable"))
    cache, reference = model.make_kv_cache(), model.make_kv_cache()
    ids = torch.randint(0, 64, (9,))
    with torch.no_grad():
        for start, stop in ((0, 5), (5, 6), (6, 9)):
            _refused_or_equal(runner, model, ids, (start, stop), cache, reference, None)


class Punica:
    """vLLM's LoRA wrapper: per-token adapter indices set on it before each step."""

    def __init__(self, indices: torch.Tensor):
        self.indices = indices


class WithLora(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.lora_a = torch.nn.Parameter(torch.randn(3, 16, 16) * 0.1)
        self.punica = Punica(torch.zeros(5, dtype=torch.long))

    def forward(self, ids):
        x = self.embed(ids)
        return x + torch.bmm(self.lora_a[self.punica.indices[: x.shape[0]]], x.unsqueeze(-1)).squeeze(-1)


def test_a_per_token_tensor_replaced_on_an_object_the_model_holds_is_refused_by_breakable_and_followed_by_dynamo():
    """Breakable's replays would read the first call's indices; Dynamo reads the object's tensor at every call."""
    torch.manual_seed(0)
    for frontend in ("breakable", "dynamo"):
        model = WithLora().eval()
        runner = piecewise.compile(model, _config(frontend))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.punica.indices = torch.randint(0, 3, (32,))  # more than the graphs take: Dynamo's slice holds
            runner(torch.randint(0, 64, (8,)))
            model.punica.indices = torch.randint(0, 3, (32,))  # the next step's, a new tensor
            ids = torch.randint(0, 64, (4,))
            if frontend == "breakable":
                with pytest.raises(ValueError, match=r"`punica\.indices` changed after the first call, and the "
                                                     r"forward reads it at .*self\.punica\.indices\["):
                    runner(ids)
            else:
                torch.testing.assert_close(runner(ids), model(ids))


class Meta:
    """Attention metadata the forward builds and keeps on an object at every run (a cache manager's mask)."""

    mask = None


class BuildsItsMeta(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.meta = torch.nn.Embedding(64, 16), Meta()

    def forward(self, ids):
        self.meta.mask = torch.ones(ids.shape[0], 1)
        return self.embed(ids) * self.meta.mask


def test_a_tensor_the_forward_itself_keeps_on_an_object_at_every_run_is_not_taken_for_a_change_after_the_first_call():
    model, twin = BuildsItsMeta().eval(), BuildsItsMeta().eval()
    twin.load_state_dict(model.state_dict())
    runner = piecewise.compile(model, _config("breakable"))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tokens in (5, 3, 8, 1):
            ids = torch.randint(0, 64, (tokens,))
            torch.testing.assert_close(runner(ids), twin(ids))
