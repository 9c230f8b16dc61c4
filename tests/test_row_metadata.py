"""Per-call metadata as a vLLM or SGLang port passes it. Per-token metadata (a sequence index per token) describes
any rows taken from a call, as the first call's checks and the captures take them, and runs right. Per-sequence
lengths that must add up to the call's rows do not: the first call is refused, naming the model's own error and
what to pass instead, rather than failing inside the model with a row count the user never gave."""

import dataclasses

import pytest
import torch

import piecewise
from piecewise.errors import ForwardRefused


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
