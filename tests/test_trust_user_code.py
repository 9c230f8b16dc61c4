"""Never silently wrong, never a raw crash, for code users bring: an expert capacity computed from the token count
(GShard's ``ceil(T / E)``) whose first call happens to drop nothing, a submodule switched to train mode after the
first call, a TorchScript submodule, and a runner called from code the caller compiles."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piecewise
from piecewise.errors import ForwardRefused

FRONTENDS = ["dynamo", "breakable", "auto"]
H, E = 16, 2


class CapacityMoE(nn.Module):
    """Top-1 routing by the sign of the first feature; each expert keeps at most ceil(T / E) tokens, in token order,
    and drops the rest (the residual passes them through)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        with torch.no_grad():
            self.gate.weight.zero_()
            self.gate.weight[0, 0], self.gate.weight[1, 0] = 10.0, -10.0
        self.w = nn.Parameter(torch.randn(E, H, H) * 0.3)

    def forward(self, x):
        p, e = self.gate(x).softmax(-1).max(-1)
        capacity = math.ceil(x.shape[0] / E)
        onehot = F.one_hot(e, E)
        position = (onehot.cumsum(0) - 1) * onehot
        keep = ((position < capacity) & (onehot > 0)).any(-1)
        y = torch.einsum("th,thk->tk", x, self.w[e]) * p[:, None]
        return x + y * keep[:, None].to(y.dtype)


def routed(signs: list[int], seed: int) -> torch.Tensor:
    x = torch.randn(len(signs), H, generator=torch.Generator().manual_seed(seed))
    x[:, 0] = torch.tensor(signs, dtype=torch.float32) * (1.0 + x[:, 0].abs())
    return x


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_capacity_from_the_token_count_is_refused_though_the_first_call_drops_nothing(frontend):
    """The first call routes 3 and 2 tokens to the two experts (capacity 3 unpadded, 4 padded to 8): nothing is
    dropped either way, yet a later call of 4 and 1 would keep padded the token eager drops."""
    torch.manual_seed(0)
    runner = piecewise.compile(CapacityMoE().eval(), piecewise.CaptureConfig(
        capture_sizes=[1, 2, 4, 8], frontend=frontend, compiler="eager", cache_dir=None))
    with pytest.raises(ForwardRefused, match=r"token count for a value.*every one a copy of the call's first") as info:
        runner(routed([1, -1, 1, -1, 1], 0))
    assert info.value.kind == "token_mixing"
    assert "a capacity computed from the count" in str(info.value)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_fixed_capacity_in_token_order_is_served_exactly(frontend):
    """A capacity that does not follow the count (Switch Transformers' expert_capacity) drops the same tokens padded:
    the check on copies of the first row passes, and every call matches eager."""

    class FixedCapacity(CapacityMoE):
        def forward(self, x):
            p, e = self.gate(x).softmax(-1).max(-1)
            onehot = F.one_hot(e, E)
            keep = ((((onehot.cumsum(0) - 1) * onehot) < 3) & (onehot > 0)).any(-1)
            return x + torch.einsum("th,thk->tk", x, self.w[e]) * (p * keep.to(p.dtype))[:, None]

    torch.manual_seed(0)
    model = FixedCapacity().eval()
    reference = copy.deepcopy(model)
    runner = piecewise.compile(model, piecewise.CaptureConfig(
        capture_sizes=[1, 2, 4, 8], frontend=frontend, compiler="eager", cache_dir=None))
    for seed, signs in enumerate([[1, -1, 1, -1, 1], [1, 1, 1, 1, -1], [1, 1, 1, 1, 1, -1, 1], [-1, -1, -1]]):
        x = routed(signs, seed)
        torch.testing.assert_close(runner(x), reference(x), rtol=1e-5, atol=1e-5)
    assert runner.stats["eager_calls"] == 0


class WithDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(H, H), nn.Linear(H, H)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.b(self.drop(self.a(x)))


def dropout_switched_and_back(frontend: str, device: str):
    """The first call in eval mode; the dropout alone switched to train mode (the call runs the model's own forward,
    naming it), then back. The runner, and its replays before the call back in eval mode."""
    torch.manual_seed(0)
    model = WithDropout().eval().to(device)
    reference = copy.deepcopy(model)
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4, 8], frontend=frontend,
                                                              cache_dir=None))
    x = torch.randn(5, H, device=device)
    runner(x)
    model.drop.train()
    reference.drop.train()
    with pytest.warns(UserWarning, match=r"submodule `drop` is in train mode now and was in eval mode"):
        torch.manual_seed(1)
        got = runner(x)
    torch.manual_seed(1)
    want = reference(x)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(want, model.b(model.a(x)))  # the dropout acted: a replay in eval mode would differ
    assert runner.stats["eager_calls"] == 1
    model.drop.eval()
    reference.drop.eval()
    replays = runner.stats["replays"]
    torch.testing.assert_close(runner(x[:3]), reference(x[:3]))
    assert runner.stats["eager_calls"] == 1
    return runner, replays


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_submodule_switched_to_train_mode_runs_eagerly_with_a_warning_naming_it(frontend):
    """Replays keep the mode of their capture (a dropout left out): a submodule's mode changed since the first call
    sends the call to the model's own forward, naming the submodule; back in eval mode the runner serves again."""
    dropout_switched_and_back(frontend, "cpu")


class Scripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.jit.script(nn.Sequential(nn.Linear(H, H), nn.ReLU()))
        self.out = nn.Linear(H, H)

    def forward(self, x):
        return self.out(self.mlp(x))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_torchscript_submodule_is_served(frontend):
    """A ``torch.jit.script`` submodule: its class has no plain ``forward`` to watch (this was a raw AttributeError)."""
    torch.manual_seed(0)
    model = Scripted().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4, 8], frontend=frontend,
                                                              cache_dir=None))
    with torch.no_grad():
        for tokens in (5, 3, 8):
            x = torch.randn(tokens, H)
            torch.testing.assert_close(runner(x), model(x))


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("first", ["inside", "outside"])
def test_a_runner_called_from_compiled_code_runs_as_it_does_outside(frontend, first):
    """``torch.compile(lambda x: runner(x) * 2)``: the runner's call is a graph break, its first call included
    (this was Dynamo's raw "forbidden callable" for ``mark_dynamic``)."""
    torch.manual_seed(0)
    model = WithDropout().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4, 8], frontend=frontend,
                                                              cache_dir=None))
    if first == "outside":
        runner(torch.randn(5, H))
    compiled = torch.compile(lambda x: runner(x) * 2, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's note about the graph break
        for tokens in (5, 3, 8, 1):
            x = torch.randn(tokens, H)
            torch.testing.assert_close(compiled(x), model(x) * 2)
    assert runner.stats["eager_calls"] == 0


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_runner_cannot_be_copied_and_says_what_to_copy(how):
    import pickle

    runner = piecewise.compile(WithDropout().eval(), piecewise.CaptureConfig(capture_sizes=[1, 2, 4, 8],
                                                                             cache_dir=None))
    runner(torch.randn(3, H))
    with pytest.raises(TypeError, match=r"cannot be copied or pickled: copy or pickle the model"):
        copy.deepcopy(runner) if how == "deepcopy" else pickle.dumps(runner)


class IndexedHead(nn.Module):
    """vLLM's compute_logits at `logits_indices` (the last token of each sequence), taken inside forward."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(64, H), nn.Linear(H, 64)

    def forward(self, input_ids, positions, logits_indices):
        return self.head((self.emb(input_ids) + positions[:, None])[logits_indices])


REFERENCE_INPUTS = {}
"""A caller's reference copy of its inputs, in a global of the model's file: not what the forward reads."""


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_an_index_argument_into_the_rows_is_named_not_a_copy_in_a_global(frontend):
    torch.manual_seed(0)
    ids, positions = torch.randint(0, 64, (8,)), torch.arange(8)
    REFERENCE_INPUTS.update(input_ids=ids.clone(), positions=positions.clone())
    runner = piecewise.compile(IndexedHead().eval(), piecewise.CaptureConfig(frontend=frontend, max_tokens=16,
                                                                             cache_dir=None))
    try:
        with pytest.raises(ForwardRefused, match=r"`logits_indices` index the call's rows \(up to 7\).*Index the "
                                                 r"output after the runner returns") as info:
            runner(ids, positions, torch.tensor([4, 7, 7, 7]))
        assert "REFERENCE_INPUTS" not in str(info.value)
    finally:
        REFERENCE_INPUTS.clear()


def test_a_call_while_another_thread_compiles_runs_as_usual(monkeypatch):
    """torch's compiling flag is the process's: set through another thread's compile (or an export), a call that
    Dynamo does not trace still runs the runner once (this recursed without end)."""
    torch.manual_seed(0)
    model = WithDropout().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4, 8], cache_dir=None))
    x = torch.randn(5, H)
    torch.testing.assert_close(runner(x), model(x))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(runner(x[:3]), model(x[:3]))
    assert runner.stats["eager_calls"] == 0


class GrowingCache(nn.Module):
    """A cache grown with torch.cat in a module attribute inside forward (transformers' DynamicCache, kept on the
    module), and attention over it in plain code."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)
        self.k = self.v = None

    def forward(self, x):
        q, k, v = self.qkv(x).split(H, -1)
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])
        mask = torch.ones(x.shape[0], self.k.shape[0], dtype=torch.bool).tril(self.k.shape[0] - x.shape[0])
        return F.scaled_dot_product_attention(q[None], self.k[None], self.v[None], attn_mask=mask)[0]


def test_a_refusal_names_the_attributes_the_first_calls_runs_set():
    """Breakable runs the forward's Python at each of the first call's runs: the cache grows at each, and the
    refusal says so besides the difference it found, and puts the attributes back."""
    torch.manual_seed(0)
    model = GrowingCache().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4, 8], frontend="breakable",
                                                              cache_dir=None))
    with pytest.raises(ForwardRefused, match=r"also set the model's Python attributes `self\.k`, `self\.v` each "
                                             r"time.*a cache grown with torch\.cat"):
        runner(torch.randn(5, H))
    assert model.k is None and model.v is None


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Outer(nn.Module):
    """vLLM's LlamaForCausalLM around LlamaModel: the inner model runs piecewise, the head after it."""

    def __init__(self):
        super().__init__()
        self.model, self.head = Inner(), nn.Linear(H, 4)
        self.runner = None

    def forward(self, x):
        return self.head((self.runner or self.model)(x))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_forward_patched_with_its_own_runner_is_named_and_the_runner_beside_the_module_works(frontend):
    """``model.forward = piecewise.compile(model)`` (torch.compile's habit) made the runner call itself: a raw
    AttributeError from inside the first call. It is named, and the runner works once the patch is gone; a runner
    kept beside the inner module and called from the outer forward serves exactly."""
    torch.manual_seed(0)
    model = Inner().eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    model.forward = runner
    x = torch.randn(5, H)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"called from inside its own call \(model.forward = runner"):
            model(x)
        del model.forward
        torch.testing.assert_close(runner(x), model(x))
        outer = Outer().eval()
        outer.runner = piecewise.compile(outer.model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend,
                                                                              cache_dir=None))
        for tokens in (5, 3, 8):
            x = torch.randn(tokens, H)
            got = outer(x)
            outer_eager = outer.head(outer.model(x))
            torch.testing.assert_close(got, outer_eager)


@piecewise.opaque_op("test_trust_user_code::doubled", split=True)
def doubled(q: torch.Tensor) -> torch.Tensor:
    return q * 2


def _untraceable(x):
    torch._dynamo.graph_break()  # any Python Dynamo cannot trace (a JIT library's call, a lock)
    return x


class BatchFirstBreak(nn.Module):
    """Activations [1, T, H], as transformers' and gpt-fast's are, and a graph break after the splitting op."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.emb, self.a, self.b = nn.Embedding(32, H), nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, ids):
        x = self.a(self.emb(ids)[None] if self.batch_first else self.emb(ids))
        y = doubled(x[0] if self.batch_first else x)
        return self.b(_untraceable(y[None] if self.batch_first else y))


@pytest.mark.parametrize("batch_first", [False, True])
def test_batch_first_activations_after_a_graph_break_are_served_by_dynamo(batch_first):
    """After a break the graphs are traced per size: a [1, T, H] tensor was taken for a value that combines the
    token rows, and its padded rows were not cut, so the forward was refused for the token count ("differs by
    inf")."""
    torch.manual_seed(0)
    model = BatchFirstBreak(batch_first).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend="dynamo", cache_dir=None))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph break's
        for tokens in (5, 3, 16, 9):
            ids = torch.randint(0, 32, (tokens,))
            torch.testing.assert_close(runner(ids), model(ids))


class _StepContext:
    """vLLM's forward context under fast_moe_cold_start: each MoE call takes the next layer's name from it."""

    def __init__(self, layers: int):
        self.names, self.index = [f"layer{i}" for i in range(layers)], 0

    def next_layer(self) -> str:
        assert self.index < len(self.names), "more MoE calls than MoE layers in this step"
        self.index += 1
        return self.names[self.index - 1]


_STEP: list[_StepContext] = []  # set by the engine before each step
_LAYERS: dict[str, nn.Module] = {}  # vLLM's static_forward_context: the layers by name


@torch.library.custom_op("test_trust_user_code::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor) -> torch.Tensor:
    """vLLM's ``moe_forward`` with its layer name taken from the step's context."""
    return _LAYERS[_STEP[-1].next_layer()](x)


@moe_forward.register_fake
def _(x):
    return torch.empty_like(x)


class CountedLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({f"layer{i}": nn.Linear(H, H) for i in range(2)})
        _LAYERS.update(self.layers)

    def forward(self, x):
        for _ in range(2):
            x = moe_forward(x)
        return x


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_state_the_forward_advances_on_every_run_is_named(frontend):
    """The first call runs the forward several times inside one engine step: Dynamo's refusal blamed per-sequence
    lengths, breakable raised the model's own AssertionError."""
    torch.manual_seed(0)
    runner = piecewise.compile(CountedLayers().eval(), piecewise.CaptureConfig(max_tokens=8, frontend=frontend,
                                                                                cache_dir=None))
    _STEP[:] = [_StepContext(2)]
    with torch.no_grad(), pytest.raises(ForwardRefused, match=r"more MoE calls than MoE layers.*state the forward "
                                                              r"advances on every run") as refused:
        runner(torch.randn(5, H))
    assert refused.value.kind == "state_update"
