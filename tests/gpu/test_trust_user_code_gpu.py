"""``tests/test_trust_user_code.py`` with CUDA graphs replayed: a submodule switched to train mode after the first call
runs the model's own forward (a replay would keep the capture's eval mode, its dropout left out), an expert capacity
from the token count is refused, and a runner called from compiled code replays its graphs."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

import piecewise
from piecewise.errors import ForwardRefused

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import test_trust_user_code as cases  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("frontend", ["dynamo", "breakable"])
def test_a_submodule_in_train_mode_is_not_replayed_in_eval_mode(frontend):
    runner, replays = cases.dropout_switched_and_back(frontend, "cuda")
    assert runner.stats["graphs"] > 0 and runner.stats["replays"] > replays  # back in eval mode: replayed


@pytest.mark.parametrize("frontend", cases.FRONTENDS)
def test_a_capacity_from_the_token_count_is_refused(frontend):
    torch.manual_seed(0)
    runner = piecewise.compile(cases.CapacityMoE().eval().cuda(), piecewise.CaptureConfig(
        capture_sizes=[1, 2, 4, 8], frontend=frontend, cache_dir=None))
    with pytest.raises(ForwardRefused, match=r"every one a copy of the call's first"):
        runner(cases.routed([1, -1, 1, -1, 1], 0).cuda())


@pytest.mark.parametrize("frontend", cases.FRONTENDS)
def test_a_runner_called_from_compiled_code_replays(frontend):
    torch.manual_seed(0)
    model = cases.WithDropout().eval().cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4, 8], frontend=frontend,
                                                              cache_dir=None))
    compiled = torch.compile(lambda x: runner(x) * 2, backend="eager")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tokens in (5, 3, 8, 1):
            x = torch.randn(tokens, cases.H, device="cuda")
            torch.testing.assert_close(compiled(x), model(x) * 2)
    assert runner.stats["replays"] > 0 and runner.stats["eager_calls"] == 0


@pytest.mark.parametrize("frontend", ["dynamo", "breakable", "auto"])
def test_an_index_argument_into_the_rows_is_refused_before_it_ends_the_cuda_context(frontend):
    """`head(h[logits_indices])` inside forward: the first call's runs on fewer rows would index past them, a
    device-side assert that ended the process's CUDA context. The model's own forward on the fewest rows runs with
    its indices checked first."""
    torch.manual_seed(0)
    model = cases.IndexedHead().eval().cuda()
    runner = piecewise.compile(model, piecewise.CaptureConfig(frontend=frontend, max_tokens=16, cache_dir=None))
    ids, positions = torch.randint(0, 64, (8,), device="cuda"), torch.arange(8, device="cuda")
    with pytest.raises(ForwardRefused, match=r"`logits_indices` index the call's rows \(up to 7\).*Index the output "
                                             r"after the runner returns"):
        runner(ids, positions, torch.tensor([4, 7, 7, 7], device="cuda"))
    torch.cuda.synchronize()  # the context lives on
    assert torch.ones(4, device="cuda").sum().item() == 4


@pytest.mark.parametrize("frontend", cases.FRONTENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_a_count_kept_in_a_buffer_is_refused_or_exact_with_replays(frontend, dtype):
    """An integer count kept with ``fill_(x.shape[0])`` held the padded count under breakable's replays; a forward
    reading the count before writing saw the first call's own write in that call under Dynamo."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from test_trust_count_and_state import KeptCount

    torch.manual_seed(0)
    model, twin = KeptCount(dtype).eval().cuda(), KeptCount(dtype).eval().cuda()
    twin.load_state_dict(model.state_dict())
    runner = piecewise.compile(model, piecewise.CaptureConfig(capture_sizes=[1, 2, 4, 8], frontend=frontend,
                                                              cache_dir=None))
    with torch.no_grad():
        for index, tokens in enumerate((5, 3, 7, 2)):
            x = torch.randn(tokens, 8, device="cuda")
            try:
                out = runner(x)
            except ForwardRefused as refused:
                assert index == 0 and "buffer `kept`" in str(refused), refused
                return
            torch.testing.assert_close(out, twin(x), msg=f"call {index} ({tokens} tokens)")
            assert model.kept.item() == twin.kept.item() == tokens
    assert runner.stats["replays"] > 0
