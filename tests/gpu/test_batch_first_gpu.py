"""Models called as their authors call them, batch-first, with graphs captured and replayed: gpt-fast's ids [1, T]
with positions [T] and caches in buffers, and a plain transformers model's input_ids [1, T]. Outputs and caches
equal eager; nothing comes back padded or in graph memory."""

import pytest
import torch

import piecewise
from piecewise.errors import ForwardRefused

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("frontend, dynamic, compiler, batch", [
    ("dynamo", None, "eager", 1), ("breakable", None, "eager", 1), ("dynamo", {"idx": 1, "input_pos": 0}, "eager", 1),
    ("breakable", {"idx": 1, "input_pos": 0}, "eager", 1), ("auto", None, "auto", 1), ("dynamo", None, "eager", 3),
    ("breakable", None, "eager", 3)])
def test_a_gpt_fast_style_model_decodes_batch_first_with_graphs(frontend, dynamic, compiler, batch):
    """Batch 3: ids [3, T] beside positions [T], the tokens found in dimension 1 by themselves."""
    from fixtures.state_models import BatchFirstCache

    torch.manual_seed(0)
    model = BatchFirstCache(batch=batch).cuda().eval()
    ids = torch.randint(0, 100, (batch, 14), device="cuda")

    def generate(call):
        for layer in model.layers:
            layer.k.zero_()
            layer.v.zero_()
        with torch.no_grad():
            steps = [call(ids[:, :6], torch.arange(6, device="cuda")),
                     call(ids[:, 6:9], torch.arange(6, 9, device="cuda"))]
            steps += [call(ids[:, p : p + 1], torch.tensor([p], device="cuda")) for p in range(9, 14)]
        return [s.clone() for s in steps], [layer.k.clone() for layer in model.layers]

    expected, expected_cache = generate(model)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, compiler=compiler,
                                                              cache_dir=None), dynamic=dynamic)
    got, cache = generate(runner)  # compiler="auto": the search's candidates take the arguments tokens-first
    kept = [g.clone() for g in got]  # outputs are the caller's: later calls leave them alone
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    for a, b in zip(cache, expected_cache):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    generate(runner)
    for g, k in zip(got, kept):
        assert torch.equal(g, k)
    assert runner.token_arguments == {"idx": 1, "input_pos": 0}
    assert runner.stats.replays + runner.stats.full_replays > 0 and runner.stats["eager_calls"] == 0


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_plain_transformers_model_batch_first_with_graphs(frontend):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).cuda().eval()
    ids = torch.randint(0, 128, (1, 13), device="cuda")
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cache_dir=None))
    with torch.no_grad(), pytest.raises(ForwardRefused) as info:
        runner(ids[:, :7])
    assert info.value.kind == "output_object" and "use_cache=False" in str(info.value)
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, cache_dir=None))
    with torch.no_grad():
        for length in (7, 13, 3, 1, 7):
            torch.testing.assert_close(runner(ids[:, :length], use_cache=False).logits,
                                       model(ids[:, :length], use_cache=False).logits, rtol=1e-4, atol=1e-4)
    assert runner.token_arguments == {"input_ids": 1} and runner.stats.replays + runner.stats.full_replays > 0


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_token_arguments_other_dimension_that_changes_is_never_replayed_into_the_old_buffers(frontend):
    model = _Scale().cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend=frontend, cache_dir=None))
    with torch.no_grad():
        runner(torch.randn(3, 4, device="cuda"))
        x = torch.randn(3, 6, device="cuda")
        with pytest.warns(UserWarning, match=r"argument 'x' has shape \(3, 6\) and had \(3, 4\)"):
            torch.testing.assert_close(runner(x), model(x))


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return torch.nn.functional.gelu(x * self.scale)
