"""Per-call metadata as a vLLM or SGLang port passes it. Per-token metadata (a sequence index per token) describes
any rows taken from a call, as the first call's checks and the captures take them, and runs right. Per-sequence
lengths that must add up to the call's rows, and per-token tensors inside an argument object, do not: the first
call is refused, naming the model's own error and what to pass instead. Tensors read from a global forward
context: Dynamo reads them anew at every call; breakable, whose replays run no Python, refuses them naming the
line (tensors kept on the model's modules are the model's)."""

import dataclasses
import re

import pytest
import torch

import piecewise
from piecewise.errors import ForwardRefused

from fixtures import state_models  # noqa: E402


@piecewise.opaque_op("row_metadata_tests::varlen_cumsum", split=True, fake=lambda x, lengths: x.new_empty(x.shape))
def varlen_cumsum(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A running sum within each sequence, sequences given by their lengths (cu_seqlens-style)."""
    if int(lengths.sum()) != x.shape[0]:
        raise ValueError(f"varlen_cumsum: lengths add up to {int(lengths.sum())}, not the {x.shape[0]} rows")
    return torch.cat([part.cumsum(0) for part in x.split(lengths.tolist())])


@piecewise.opaque_op("row_metadata_tests::per_token_cumsum", split=True,
                     fake=lambda x, sequence: x.new_empty(x.shape))
def per_token_cumsum(x: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
    """The same running sum, sequences given by each token's sequence index."""
    same = sequence[:, None] == sequence[None, :]
    earlier = torch.ones(len(sequence), len(sequence), dtype=torch.bool, device=x.device).tril()
    return (same & earlier).to(x.dtype) @ x


class Mixer(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x, metadata):
        return self.b(self.op(self.a(x), metadata))


@pytest.mark.parametrize("frontend", ["auto", "dynamo", "breakable"])
def test_per_sequence_lengths_are_refused_at_the_first_call_naming_the_models_error(frontend):
    torch.manual_seed(0)
    runner = piecewise.compile(Mixer(varlen_cumsum).eval(),
                               piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None),
                               dynamic={"x": 0})
    with torch.no_grad(), pytest.raises(ForwardRefused) as info:
        runner(torch.randn(5, 8), torch.tensor([2, 3]))
    assert info.value.kind == "token_layout"
    message = str(info.value)
    assert "made from the first call's 5" in message and "varlen_cumsum: lengths add up to 5" in message
    assert "per-sequence lengths or cumulative offsets" in message and "per-token metadata" in message


@pytest.mark.parametrize("frontend", ["auto", "dynamo", "breakable"])
def test_per_token_sequence_indices_run_right(frontend):
    torch.manual_seed(0)
    model = Mixer(per_token_cumsum).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None),
                               dynamic={"x": 0, "metadata": 0})
    with torch.no_grad():
        for sequence in ([0, 0, 1, 1, 1], [0, 1, 1], [2, 0, 0, 0, 1, 1]):
            x, metadata = torch.randn(len(sequence), 8), torch.tensor(sequence)
            torch.testing.assert_close(runner(x, metadata), model(x, metadata))


@dataclasses.dataclass
class Metadata:
    """Per-token tensors inside an object, as SGLang's ForwardBatch and vLLM's attention metadata hold them."""

    scale: torch.Tensor
    sequence: torch.Tensor


class ScaledByMetadata(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x, metadata: Metadata):
        return self.a(x) * metadata.scale[:, None]  # eager broadcasts a 1-row x against 3 scales without a word


@pytest.mark.parametrize("frontend", ["auto", "dynamo", "breakable"])
def test_token_tensors_inside_an_argument_object_are_refused_naming_them(frontend):
    runner = piecewise.compile(ScaledByMetadata().eval(),
                               piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused) as info:
        runner(torch.randn(3, 8), Metadata(torch.rand(3), torch.arange(3)))
    assert info.value.kind == "token_layout"
    assert "metadata.scale, metadata.sequence kept the first call's 3 rows" in str(info.value)
    assert "Pass them as arguments of forward" in str(info.value)


class Context:
    """An engine's forward context: tensors the caller puts there before each call."""

    scale: torch.Tensor


CONTEXT = Context()


class ReadsTheContext(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) * CONTEXT.scale


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_breakable_refuses_a_tensor_read_from_a_global_naming_the_line_and_dynamo_reads_it_anew(compiler,
                                                                                                monkeypatch):
    """A breakable replay runs no Python: it would read the first call's tensor after the caller replaced it. With
    Inductor regions the global is an input Dynamo lifted into the region (a stand-in compiler here: no C++ build)."""
    from piecewise.capture import compilers

    monkeypatch.setattr(compilers.InductorCompiler, "compile", lambda self, graph, example_inputs: graph.forward)
    model = ReadsTheContext().eval()
    CONTEXT.scale = torch.rand(8)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="breakable", compiler=compiler,
                                                              cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused) as info:
        runner(torch.randn(3, 8))
    assert info.value.kind == "frozen_value"
    if compiler == "eager":
        assert "`mul` at" in str(info.value) and "CONTEXT.scale" in str(info.value)  # the line, quoted
    else:
        assert re.search(r"a compiled region at .*its input `\w*context_scale\w*`", str(info.value), re.I)
    assert "Pass it as an argument of forward, register it on a module" in str(info.value)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=None))  # auto: Dynamo
    with torch.no_grad():
        for tokens in (3, 3, 5):
            CONTEXT.scale = torch.rand(8)
            x = torch.randn(tokens, 8)
            torch.testing.assert_close(runner(x), model(x))
    assert runner.stats.frontend == "dynamo"


class ReadsItsOwnTable(torch.nn.Module):
    """Tensors kept on modules without registering them, built in __init__ or on the first forward: the model's."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.table = {"scale": torch.rand(8)}
        self.cached = None

    def forward(self, x):
        if self.cached is None:
            self.cached = torch.rand(8)
        return self.a(x) * self.table["scale"] + self.cached


class BuildsConstants(torch.nn.Module):
    """An empty tensor built inside forward (``torch.tensor([])``), as transformers' cache layers start."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        keys = torch.cat([torch.tensor([], dtype=x.dtype, device=x.device), x[:, 0]])
        return self.a(x) + keys[:, None]


SETTINGS = {"scale": 0.5}


class ReadsAPythonValue(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) * torch.tensor(SETTINGS["scale"], device=x.device)


def test_a_tensor_built_from_python_values_is_refused_by_breakable_and_read_anew_by_dynamo():
    """``torch.tensor(value)`` inside forward: a breakable replay would keep the capture's value after the Python
    value changed."""
    model = ReadsAPythonValue().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="breakable", cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused) as info:
        runner(torch.randn(3, 8))
    assert info.value.kind == "frozen_value" and "`torch.tensor(...)` at" in str(info.value)
    assert "SETTINGS" in str(info.value) and "register_buffer" in str(info.value)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="dynamo", cache_dir=None))
    with torch.no_grad():
        for tokens, scale in ((3, 0.5), (3, 2.0), (5, 3.0)):
            SETTINGS["scale"] = scale
            x = torch.randn(tokens, 8)
            torch.testing.assert_close(runner(x), model(x))
    SETTINGS["scale"] = 0.5


@pytest.mark.parametrize("make", [ReadsItsOwnTable, BuildsConstants])
def test_breakable_takes_tensors_the_model_keeps_or_the_forward_builds(make):
    torch.manual_seed(0)
    model = make().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="breakable", cache_dir=None))
    with torch.no_grad():
        for tokens in (3, 1, 6):
            x = torch.randn(tokens, 8)
            torch.testing.assert_close(runner(x), model(x))
    assert runner.stats.frontend == "breakable"


class MultiAxisPositions(torch.nn.Module):
    """vLLM's M-RoPE: positions [3, tokens], the tokens in dimension 1."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.out = torch.nn.Linear(16, 16)
        self.register_buffer("freq", torch.rand(3, 16))

    def forward(self, input_ids, positions):
        angles = (positions.T.float()[:, :, None] * self.freq[None]).sum(1)
        return self.out(self.embed(input_ids) * angles.cos())


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_positions_with_the_tokens_in_dimension_1_run_right_once_named(frontend):
    torch.manual_seed(0)
    model = MultiAxisPositions().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cache_dir=None),
                               dynamic={"input_ids": 0, "positions": 1})
    with torch.no_grad():
        for tokens in (5, 3, 9, 1, 16, 12):
            ids, positions = torch.randint(0, 50, (tokens,)), torch.randint(0, 100, (3, tokens))
            torch.testing.assert_close(runner(ids, positions), model(ids, positions))
    assert runner.stats["padded_calls"] >= 4 and runner.stats["eager_calls"] == 0


@pytest.mark.parametrize("frontend", ["auto", "dynamo", "breakable"])
def test_positions_with_the_tokens_in_dimension_1_unnamed_are_refused_naming_the_fix(frontend):
    """Taken as a static argument, positions [3, 5] breaks the rows the first call makes (Dynamo: in its trace,
    where the model's own forward broadcasts a single row): refused with the model's error and the dynamic= to
    pass, never Dynamo's raw fake-tensor error."""
    model = MultiAxisPositions().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused) as info:
        runner(torch.randint(0, 50, (5,)), torch.randint(0, 100, (3, 5)))
    assert info.value.kind == "token_layout"
    assert "'positions' has shape (3, 5): if that dimension carries the tokens, name it: dynamic={'input_ids': 0, " \
           "'positions': 1}" in str(info.value)


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_dataclass_output_is_cut_to_the_tokens_and_copied(frontend):
    torch.manual_seed(0)
    model = state_models.ReturnsADataclass().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    kept = []
    with torch.no_grad():
        for tokens in (3, 5, 1, 8, 3):
            x = torch.randn(tokens, 8)
            got, want = runner(x), model(x)
            assert isinstance(got, state_models.Logits) and got.next_token_logits.shape == (tokens, 16)
            torch.testing.assert_close(got.next_token_logits, want.next_token_logits)
            torch.testing.assert_close(got.hidden_states, want.hidden_states)
            kept.append((got, want))
    for got, want in kept:  # each call's result is its own, not graph memory a later call overwrote
        torch.testing.assert_close(got.next_token_logits, want.next_token_logits)
    assert runner.stats["padded_calls"] >= 3


class EmbedsOrIds(torch.nn.Module):
    """vLLM's signature: ``input_ids`` or ``inputs_embeds``, the other None."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(50, 16)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        return self.out(hidden) + positions[:, None].float()


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("dynamic", [None, {"input_ids": 0, "positions": 0, "inputs_embeds": 0}])
def test_inputs_embeds_with_input_ids_none_runs_right_and_ids_later_run_eagerly(frontend, dynamic):
    torch.manual_seed(0)
    model = EmbedsOrIds().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cache_dir=None),
                               dynamic=dynamic)
    with torch.no_grad():
        for tokens in (5, 3, 9, 1):
            embeds, positions = torch.randn(tokens, 16), torch.arange(tokens)
            torch.testing.assert_close(runner(None, positions, inputs_embeds=embeds),
                                       model(None, positions, inputs_embeds=embeds))
        ids = torch.randint(0, 50, (4,))
        with pytest.warns(UserWarning, match="argument 'input_ids' is given now and was not at the first call"):
            torch.testing.assert_close(runner(ids, torch.arange(4)), model(ids, torch.arange(4)))
    assert runner.stats["padded_calls"] >= 3 and runner.stats["eager_calls"] == 1
    assert {"positions", "inputs_embeds"} <= set(runner.token_arguments)


class MixesTokensInADataclass(state_models.ReturnsADataclass):
    def forward(self, x):
        hidden = self.a(x)
        return state_models.Logits(self.head(hidden - hidden.mean(0)), hidden)


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_the_padding_check_reads_a_dataclass_outputs_fields(frontend):
    """A mean over the tokens inside a dataclass output is found by the padding check (which saw the dataclass as
    one leaf, nothing to compare, and let padding-dependent numbers through)."""
    runner = piecewise.compile(MixesTokensInADataclass().eval(),
                               piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused) as info:
        runner(torch.randn(3, 8))
    assert info.value.kind == "token_mixing"


@dataclasses.dataclass
class WithExtra:
    logits: torch.Tensor

    def __post_init__(self):
        self.scaled = self.logits * 2  # not a field: not cut


class Slotted:
    __slots__ = ("hidden",)

    def __init__(self, hidden):
        self.hidden = hidden


class PrivateSlot:
    __slots__ = "__hidden"

    def __init__(self, hidden):
        self.__hidden = hidden


def nested_config(levels):
    config = {"name": "leaf"}
    for level in range(levels):
        config = {"level": level, "inner": config}
    return config


class ReturnsAnObject(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.kind = kind

    def forward(self, x):
        hidden = self.a(x)
        if self.kind == "post_init":
            return WithExtra(hidden)
        if self.kind == "private_slot":
            return hidden, PrivateSlot(hidden)
        if self.kind == "config":  # objects deeper than any fixed walk, and no tensor among them: served
            return hidden, nested_config(40)
        return (hidden, Slotted(hidden)) if self.kind == "slots" else (hidden,)


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
@pytest.mark.parametrize("kind, path", [("post_init", "WithExtra.scaled"), ("slots", "Slotted.hidden"),
                                        ("private_slot", "PrivateSlot._PrivateSlot__hidden")])
def test_output_objects_piecewise_would_return_padded_are_refused_at_the_first_call(frontend, kind, path):
    """Tensors the forward made inside an object ``finish`` does not cut (a dataclass attribute that is not a field,
    an object with __slots__) are refused before anything is prepared: the same runner then serves another call."""
    model = ReturnsAnObject(kind).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused) as info:
        runner(torch.randn(3, 8))
    assert info.value.kind == "output_object" and f"({path}, shape (3, 8))" in str(info.value)
    model.kind = "tensor"
    with torch.no_grad():
        x = torch.randn(3, 8)
        assert torch.equal(runner(x)[0], model(x)[0])


def test_an_output_object_deeper_than_any_fixed_walk_without_tensors_is_served():
    model = ReturnsAnObject("config").eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, cache_dir=None))
    with torch.no_grad():
        x = torch.randn(3, 8)
        hidden, config = runner(x)
    torch.testing.assert_close(hidden, model(x)[0])
    assert config == nested_config(40)


class Intermediate:
    """vLLM's IntermediateTensors: the per-token tensors one level further down, in a dict."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]


class ScaledByIntermediate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x, intermediate: Intermediate):
        return self.a(x) * intermediate["scale"][:, None]


@pytest.mark.parametrize("frontend", ["auto", "dynamo", "breakable"])
def test_token_tensors_deeper_inside_an_argument_object_are_named_too(frontend):
    runner = piecewise.compile(ScaledByIntermediate().eval(),
                               piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused) as info:
        runner(torch.randn(3, 8), Intermediate({"scale": torch.rand(3)}))
    assert "intermediate.tensors['scale'] kept the first call's 3 rows" in str(info.value)
