"""The DSA indexer's score kernel on CUDA at GLM-5's shapes (32 heads of 128, 8192 cached keys): float32 equals
the reference; bf16 within bf16 rounding, with top-2048 picks that agree with the reference's; captured in a CUDA
graph and replayed after positions and keys change in place."""

import pytest
import torch

from piecewise.kernels.indexer import index_scores, index_scores_reference

pytestmark = pytest.mark.gpu


def case(dtype, tokens=32, sequences=32, max_seq=8192, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tokens, 32, 128, device="cuda", generator=g).to(dtype)
    weights = torch.randn(tokens, 32, device="cuda", generator=g) * 32 ** -0.5
    cache = torch.randn(sequences, max_seq, 128, device="cuda", generator=g).to(dtype)
    rows = torch.arange(tokens, device="cuda") % sequences
    positions = torch.randint(0, max_seq, (tokens,), device="cuda", generator=g)
    positions[0], positions[1] = 0, max_seq - 1
    return q, weights, cache, rows, positions, 128 ** -0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_and_picks_equal_the_reference(dtype):
    args = case(dtype)
    got, want = index_scores(*args), index_scores_reference(*args)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[finite], want[finite], rtol=tol, atol=tol)
    if dtype == torch.bfloat16:
        picks = got.topk(2048, dim=-1).indices.sort(-1).values
        expected = want.topk(2048, dim=-1).indices.sort(-1).values
        agree = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(picks, expected)) / picks.numel()
        assert agree >= 0.99, agree


def test_captured_scores_follow_the_tensors_they_read():
    q, weights, cache, rows, positions, scale = case(torch.bfloat16, tokens=8, sequences=8, max_seq=4096)
    index_scores(q, weights, cache, rows, positions, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = index_scores(q, weights, cache, rows, positions, scale)
    positions.copy_(torch.tensor([5, 4095, 64, 63, 1000, 0, 2000, 3000], device="cuda"))
    cache.normal_()
    q.normal_()
    graph.replay()
    want = index_scores_reference(q, weights, cache, rows, positions, scale)
    assert torch.equal(torch.isinf(out), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(out[finite], want[finite], rtol=2e-2, atol=2e-2)
