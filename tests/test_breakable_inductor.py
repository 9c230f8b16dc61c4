"""``CaptureConfig(frontend="breakable", compiler="inductor")`` on CPU: the forward's regions between Dynamo's
graph breaks compiled by Inductor, the rest (a JIT library's subprocess under a lock) run as written, the
interceptor cutting at the splitting ops the compiled code calls. Equal to eager (outputs and caches) within
Inductor's float32 tolerance, at sizes 1..max+1, for each place of the JIT-style call, attention ops that write
and that read a cache, and grad / no_grad / inference_mode."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

import piecewise

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
import break_models as bm  # noqa: E402
from test_breakable import GRAD_MODES, MAX_TOKENS  # noqa: E402

INDUCTOR = piecewise.CaptureConfig(max_tokens=MAX_TOKENS, frontend="breakable", compiler="inductor")


def run_sequence(model, runner, mode: str, offset: int = 3) -> None:
    """Prefills of 1..MAX_TOKENS+1 tokens from ``offset``, each followed by a decode step, on fresh caches:
    outputs and caches equal eager's (Inductor reorders float32 sums: its tolerance)."""
    ours, theirs = model.make_cache(), model.make_cache()
    with GRAD_MODES[mode]():
        for tokens in range(1, MAX_TOKENS + 2):
            ours.zero_(), theirs.zero_()
            for positions in (torch.arange(tokens) + offset, torch.tensor([tokens + offset])):
                ids = torch.randint(0, 64, positions.shape)
                got = runner(ids, positions, ours)
                with torch.no_grad():
                    expected = model(ids, positions, theirs)
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"{tokens} tokens, positions {positions}: {m}")
                torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"cache after {tokens} tokens: {m}")


# Every place of the JIT-style call x every kind of splitting op; the grad mode rotates so that each place and each
# kind meets all three (the full product would compile 45 models).
CASES = [(jit_at, attention, list(GRAD_MODES)[(i + j) % 3])
         for i, jit_at in enumerate(bm.PLACES) for j, attention in enumerate(bm.ATTENTION)]


@pytest.mark.parametrize(("jit_at", "attention", "mode"), CASES)
def test_compiled_regions_equal_eager_with_a_jit_call_anywhere(jit_at, attention, mode):
    model = bm.make(jit_at, attention)
    runner = piecewise.compile(model, INDUCTOR)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to warn: Dynamo's own warnings stay off the terminal
        run_sequence(model, runner, mode)
    stats = runner.stats
    stats.expect(frontend="breakable", traces=0, fallback_calls=1)
    assert stats["compiled_regions"] >= 1
    # a write into the cache in plain code (reads_cache) is cut out of the compiled region, to run on the real rows
    assert (stats["eager_writes"] > 0) == (attention == "reads_cache")


def test_compiled_regions_run_fused_kernels_not_the_ops(monkeypatch):
    """The regions are compiled: the interceptor sees the splitting op calls but not the pointwise ops Inductor
    fused (an uncompiled forward shows every one of them)."""
    from piecewise.frontends import breakable_interceptor

    seen: dict[str, list[str]] = {}
    for compiler in ("eager", "inductor"):
        model = bm.make("mlp", "writes_cache")
        names = seen[compiler] = []
        original = breakable_interceptor.Interceptor.__torch_dispatch__

        def spy(self, func, types, args=(), kwargs=None, names=names, original=original):
            names.append(func.overloadpacket.__name__)
            return original(self, func, types, args, kwargs)

        monkeypatch.setattr(breakable_interceptor.Interceptor, "__torch_dispatch__", spy)
        if compiler == "inductor":
            monkeypatch.setattr(breakable_interceptor.CompiledInterceptor, "__torch_dispatch__",
                                torch.compiler.disable(spy, recursive=True))
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=4, frontend="breakable",
                                                                  compiler=compiler))
        cache = model.make_cache()
        with torch.no_grad():
            runner(torch.randint(0, 64, (3,)), torch.arange(3), cache)  # the first call also runs the model as written
            names.clear()
            runner(torch.randint(0, 64, (3,)), torch.arange(3) + 3, cache)  # on a CPU: the forward, no graphs
        monkeypatch.undo()
    for compiler, names in seen.items():
        assert "attend_write" in names, (compiler, sorted(set(names)))
    pointwise = {"rsqrt", "pow", "mean", "silu"}  # the norms' and the MLP's; the JIT call's own `mul` runs eagerly
    assert pointwise <= set(seen["eager"]) and not pointwise & set(seen["inductor"]), seen


def test_auto_with_inductor_takes_breakable_regions_when_dynamo_is_blocked_and_says_so():
    model = bm.make("mlp", "writes_cache")
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=MAX_TOKENS, compiler="inductor"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_sequence(model, runner, "no_grad")
    ours = [str(w.message) for w in caught if "piecewise" in str(w.message)]
    assert len(ours) == 1 and "breakable front-end with Inductor regions" in ours[0], ours
    stats = runner.stats
    stats.expect(frontend="breakable")
    assert stats["frontend_reason"].startswith("Dynamo blocked")
    assert "breakable with Inductor regions" in stats["frontend_reason"] and stats["compiled_regions"] >= 1


class SizeBranch(torch.nn.Module):
    """Another path above three tokens, in traceable code: capture sizes 1, 2, 4, 8 would pad 3 to 4."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        if x.shape[0] > 3:
            return y.relu()
        return y.sigmoid()


def test_a_token_branch_inside_a_compiled_region_is_refused_with_its_condition():
    runner = piecewise.compile(SizeBranch(), INDUCTOR)
    with torch.no_grad(), pytest.raises(ValueError, match=r"(?s)depends on the token count.*3.*padded to 4") as info:
        runner(torch.randn(5, 8))
    assert info.value.kind == "token_branch"


def test_a_transformers_llama_through_token_model_equals_its_own_forward():
    transformers = pytest.importorskip("transformers")
    from piecewise.integrations.transformers import TokenModel, enable

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 128, (3, 6))
    with torch.no_grad():
        reference = model(prompt).logits
    token_model = TokenModel(enable(model))
    runner = piecewise.compile(token_model, INDUCTOR)
    cache = token_model.make_kv_cache(max_seq_len=16, sequences=3)
    with torch.no_grad():
        # prefill all three prompts but the last token in one call of 15 tokens (above the graphs: direct) ...
        first = runner(prompt[:, :5].reshape(-1), torch.arange(5).repeat(3), cache,
                       torch.arange(3).repeat_interleave(5))
        # ... then their last tokens in one decode step of three (padded to 4)
        step = runner(prompt[:, 5], torch.full((3,), 5), cache, torch.arange(3))
    torch.testing.assert_close(first.view(3, 5, -1), reference[:, :5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step, reference[:, 5], atol=1e-4, rtol=1e-4)
    runner.stats.expect(frontend="breakable")
    assert runner.stats["compiled_regions"] >= 1


def test_a_region_compiled_for_a_runner_cut_at_other_ops_is_refused_not_run():
    """Dynamo shares compiled frames between every torch.compile of one code object: a region cut at other
    splitting ops (or compiled otherwise) must not run for this runner."""
    from piecewise.capture.stats import Stats
    from piecewise.frontends.breakable_regions import Region, Regions

    class Ladder:
        sizes = [1, 2, 4]

    model = bm.make("mlp", "writes_cache")
    ours = Regions(model, "inductor", frozenset({"break_models::attend_write"}), Ladder(), Stats(), set(), None)
    theirs = Region(("inductor", frozenset()), lambda *args: args, [])
    with pytest.raises(ValueError, match=r"(?s)another runner of the same model class.*splitting ops \[\].*"
                                         r"splitting ops \['break_models::attend_write'\]") as info:
        ours.adopt(theirs)
    assert info.value.kind == "foreign_region"
    same = Region(ours.key, lambda *args: args, [])
    ours.adopt(same)  # cut at the same ops, compiled the same way: this runner's own
    assert same in ours.used and ours.stats.compiled_regions == 1


def test_verify_passes_at_every_size_with_compiled_regions():
    model = bm.make("after_residual", "reads_cache")
    runner = piecewise.compile(model, INDUCTOR)
    cache = model.make_cache()
    with torch.no_grad():
        runner(torch.randint(0, 64, (3,)), torch.arange(3), cache)
    report = runner.verify()
    assert report.ok, str(report)
    assert [r.size for r in report.results] == runner.stats["capture_sizes"] and report.frontend == "breakable"


def test_a_gpt_fast_style_cache_assignment_in_plain_code_is_cut_out_of_the_region():
    """``cache[positions] = k`` in traced code (gpt-fast's KVCache.update): Inductor would fuse the scatter, so the
    region is cut there and the write runs op by op, on the real rows; equal to eager at 1..max+1 tokens."""
    from fixtures import state_models

    model = state_models.SetItemWriter()
    runner = piecewise.compile(model, INDUCTOR)
    ours, theirs = torch.zeros(16, 8), torch.zeros(16, 8)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tokens in (3, *range(1, MAX_TOKENS + 2)):
            x = torch.randn(tokens, 8, generator=generator)
            positions = torch.randperm(16, generator=generator)[:tokens]
            torch.testing.assert_close(runner(x, positions, ours), model(x, positions, theirs), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours, theirs, msg=f"{tokens} tokens: the cache")
    assert runner.stats["eager_writes"] >= 1 and runner.stats["compiled_regions"] >= 1


class _Times(torch.nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class _Layer(torch.nn.Module):
    """A graph break inside the layer (a JIT-style call): Dynamo traces each layer's frame on code all layers
    share. ``mlp``, ``index`` and ``inplace`` make layers differ as models do."""

    def __init__(self, mlp, index: int = 0, inplace: bool = False):
        super().__init__()
        self.lin, self.mlp, self.index, self.inplace = torch.nn.Linear(8, 8), mlp, index, inplace

    def forward(self, x):
        y = self.lin(bm.jit_scale(x))
        if self.inplace:
            y += x  # into a tensor the previous region made: a temporary, not state
        if self.index and x.shape[0] >= self.index:  # a branch on the count against a module's integer
            y = y * 2
        return self.mlp(y)


class _Stack(torch.nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _equal_at_every_count(model, top=4):
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=top, frontend="breakable",
                                                              compiler="inductor"), dynamic={"x": 0})
    with torch.no_grad():
        for tokens in (3, *range(1, top + 2)):
            x = torch.randn(tokens, 8)
            torch.testing.assert_close(runner(x), model(x), atol=1e-5, rtol=1e-5, msg=f"{tokens} tokens")
    return runner


def test_layers_of_one_class_that_differ_in_their_submodules_each_run_their_own_trace():
    """Dynamo keeps each layer frame's guards on its module (which submodules, which tensors): layer 0's compiled
    region must not run for layer 1."""
    _equal_at_every_count(_Stack(_Layer(_Times(2.0)), _Layer(_Times(3.0))))


def test_an_in_place_write_into_an_activation_across_a_graph_break_is_compiled_not_refused():
    _equal_at_every_count(_Stack(_Layer(_Times(1.0), inplace=True), _Layer(_Times(1.0), inplace=True)))


def test_a_branch_on_the_count_against_a_modules_integer_is_refused_where_padding_crosses_it():
    """``x.shape[0] >= self.index`` with index 6 and 8-token graphs: 5..8 pad to 8 and 5 takes the other path.
    An integer of a module is traced unspecialised, but it keeps its value when the guards are evaluated at each
    count (it is not the count)."""
    model = _Stack(_Layer(_Times(1.0), index=6), _Layer(_Times(1.0), index=7))
    with pytest.raises(ValueError, match=r"(?s)depends on the token count.*5\.\.") as info:
        _equal_at_every_count(model, top=8)
    assert info.value.kind == "token_branch"
    _equal_at_every_count(_Stack(_Layer(_Times(1.0), index=1)), top=4)  # true at every count: served
