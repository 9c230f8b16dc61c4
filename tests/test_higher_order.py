"""``torch.cond`` in a forward: a branch on a device value runs eagerly between pieces (Dynamo) or as the Python
``if`` it stands for (breakable); equal to eager when the predicate changes between calls, and torch's own eager
``cond`` still works afterwards."""

import pytest
import torch

import piecewise
from piecewise.errors import ForwardRefused
from piecewise.models.llama import LlamaConfig, TinyLlama

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, max_seq_len=64)


class Switched(TinyLlama):
    """A device-side switch (a buffer) choosing between two heads with ``torch.cond``."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("doubled", torch.tensor(True))

    def forward(self, input_ids, positions, kv_cache):
        logits = super().forward(input_ids, positions, kv_cache)
        return torch.cond(self.doubled, lambda h: h * 2, lambda h: h.tanh(), (logits,))


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_torch_cond_on_a_device_switch_follows_the_switch_and_equals_eager(frontend):
    torch.manual_seed(0)
    model = Switched(CONFIG).eval()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend=frontend, compiler="eager",
                                                              cache_dir=None))
    cache, reference = model.make_kv_cache(), model.make_kv_cache()
    ids, start = torch.randint(0, 64, (64,)), 0
    with torch.no_grad():
        for index, tokens in enumerate([5, 1, 3, 1, 6]):
            if index == 2:
                model.doubled.fill_(False)
            positions = torch.arange(start, start + tokens)
            out = runner(ids[start:start + tokens], positions, cache)
            with torch.inference_mode():  # torch's eager cond, after piecewise ran the forward
                want = model(ids[start:start + tokens], positions, reference)
            torch.testing.assert_close(out, want, msg=f"call {index} ({tokens} tokens)")
            start += tokens
    torch.testing.assert_close(cache, reference)
    assert runner.stats["frontend"] == frontend and runner.stats["eager_calls"] == 0
    if frontend == "dynamo":  # the cond is cut out of the pieces, and no full graph may hold it
        assert runner.stats["eager_writes"] == 1 and runner.stats["graph_mode"] == "piecewise"
        assert "torch.cond" in runner.stats["graph_mode_reason"]



class Flex(torch.nn.Module):
    """gpt-fast's attention through ``flex_attention`` (eager: torch compiles its own wrapper on every call)."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 96)

    def forward(self, ids):
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = self.qkv(self.embed(ids)).view(1, -1, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return flex_attention(q, k, v)[0].transpose(0, 1).flatten(1)


def test_flex_attention_refused_by_breakable_names_the_remedies_and_leaves_eager_flex_working():
    """Before, the refusal blamed `cond`, and torch's eager flex_attention failed for the rest of the process
    (Dynamo had marked its wrapper while it ran under breakable's dispatch mode)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    model = Flex().eval()
    ids = torch.randint(0, 64, (8,))
    with torch.no_grad():
        before = model(ids)
        runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=8, frontend="breakable"))
        with pytest.raises(ForwardRefused, match=r"higher-order op `flex_attention`.*splitting op.*dynamo"):
            runner(ids)
        torch.testing.assert_close(model(ids), before)
        q = torch.randn(1, 2, 8, 16)
        torch.testing.assert_close(flex.flex_attention(q, q, q), torch.nn.functional.scaled_dot_product_attention(q, q, q))
