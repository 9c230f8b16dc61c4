"""What a custom op captured into a graph reads from outside its arguments (``runtime/op_reads.py``), seen on CPU
with the capture flag set: the GPU tests (``tests/gpu/test_outside_tensors_gpu.py``) run it under real captures."""

import gc

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
    monkeypatch.setattr(op_reads, "_capturing", lambda: True)
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


def test_a_global_read_inside_a_captured_custom_op_is_named_and_its_freeing_seen(monkeypatch):
    CONTEXT.update(table=torch.randn(8, 4), split=torch.randn(8, 4))
    reads = _watched(Reads(), torch.randn(3, 4), monkeypatch)
    assert len(reads) == 1, [str(r) for r in reads]  # not the op's arguments, its parameter, the splitting op's read
    text = str(reads[0])
    assert "`piecewise_reads::from_context`" in text and "(8, 4) float32" in text, text
    assert "test_op_reads.py" in text and 'CONTEXT["table"]' in text, text  # the op's own line
    assert op_reads.freed(reads) is None
    CONTEXT["table"] = torch.randn(8, 4)  # the engine's next step: a new tensor, the old one dropped
    gc.collect()
    assert op_reads.freed(reads) is reads[0]
    message = op_reads.freed_message(reads[0])
    assert "freed since the first call" in message and "splitting op" in message and "argument" in message


def test_a_new_view_of_one_persistent_buffer_each_step_stays_alive(monkeypatch):
    buffer = torch.randn(8, 4)
    CONTEXT.update(table=buffer[:6], split=torch.randn(8, 4))
    reads = _watched(Reads(), torch.randn(3, 4), monkeypatch)
    assert len(reads) == 1
    CONTEXT["table"] = buffer[:5]  # vLLM slices its persistent metadata buffers anew every step
    gc.collect()
    assert op_reads.freed(reads) is None


def test_a_tensor_the_forward_made_and_stashed_in_a_global_is_not_an_outside_read(monkeypatch):
    CONTEXT.update(table=torch.randn(8, 4), split=torch.randn(8, 4))
    reads = _watched(Reads(stash=True), torch.randn(3, 4), monkeypatch)
    assert [r.shape for r in reads] == [(8, 4)], [str(r) for r in reads]


def test_outside_a_capture_nothing_is_watched():
    CONTEXT.update(table=torch.randn(8, 4), split=torch.randn(8, 4))
    model = Reads()
    watch = op_reads.watching(model, frozenset({"piecewise_reads::split_reader"}))
    with torch.inference_mode(), watch:
        out = model(torch.randn(3, 4))
    assert op_reads.settle(watch) == [] and out.shape == (3, 4)
