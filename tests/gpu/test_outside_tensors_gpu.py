"""Tensors a forward reads from outside its arguments and modules (a global forward context, as vLLM and SGLang
engines keep one), replaced by a new tensor before each call, with graphs really captured and replayed: each call
must read the new tensor, or be refused; never the first call's memory."""

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
