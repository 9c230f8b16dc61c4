"""``torch.cond`` on a device switch under CUDA graphs: Dynamo runs the branch eagerly between captured pieces (a
full graph cannot hold it); breakable refuses the branch on a device value while it captures, naming it. Never a
frozen branch."""

import os
import sys

import pytest
import torch

import piecewise
from piecewise.errors import CaptureFailed

pytestmark = pytest.mark.gpu
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from test_higher_order import CONFIG, Switched  # noqa: E402


def _model():
    torch.manual_seed(0)
    return Switched(CONFIG).to("cuda").eval()


def _run(model, runner, counts, flip_at):
    cache, reference = model.make_kv_cache().cuda(), model.make_kv_cache().cuda()
    ids, start = torch.randint(0, 64, (64,), device="cuda"), 0
    with torch.no_grad():
        for index, tokens in enumerate(counts):
            if index == flip_at:
                model.doubled.fill_(False)
            positions = torch.arange(start, start + tokens, device="cuda")
            out = runner(ids[start:start + tokens], positions, cache)
            want = model(ids[start:start + tokens], positions, reference)
            torch.testing.assert_close(out, want, msg=f"call {index} ({tokens} tokens)")
            start += tokens
    torch.testing.assert_close(cache, reference)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_dynamo_runs_torch_cond_between_captured_pieces_and_follows_the_switch(compiler):
    model = _model()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend="dynamo", compiler=compiler,
                                                              cache_dir=None))
    with pytest.warns(UserWarning, match=r"full graphs are off for this model \(.*torch.cond .*takes a branch on the "
                                         r"host at every call"):
        _run(model, runner, [5, 1, 3, 1, 6, 2], flip_at=3)
    assert runner.stats["replays"] > 0 and runner.stats["eager_calls"] == 0
    assert runner.stats["full_replays"] == 0


def test_breakable_refuses_torch_cond_on_a_device_value_while_it_captures():
    model = _model()
    runner = piecewise.compile(model, piecewise.CaptureConfig(max_tokens=16, frontend="breakable", cache_dir=None))
    with pytest.raises(CaptureFailed, match=r"`(is_nonzero|item|_local_scalar_dense)` at .*test_higher_order.py"):
        _run(model, runner, [5, 1], flip_at=None)
