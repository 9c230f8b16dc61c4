"""The DSA indexer's scores over its key cache (``kernels.indexer``) on CPU: the reference against the sum written
out per token, head and key; the Triton kernel under the interpreter against the reference."""

import torch
from test_attention_kernel import run_interpreted

from piecewise.kernels.indexer import index_scores_reference

def case(seed: int = 0, dtype=torch.float32):
    """Three sequences of a 150-row cache; tokens at block edges (0, 63, 64, 149) and between them."""
    g = torch.Generator().manual_seed(seed)
    heads, dim, sequences, max_seq = 16, 32, 3, 150
    positions = torch.tensor([0, 5, 63, 64, 100, 149, 127])
    rows = torch.tensor([0, 1, 2, 0, 1, 2, 1])
    q = torch.randn(len(positions), heads, dim, generator=g).to(dtype)
    weights = torch.randn(len(positions), heads, generator=g)
    cache = torch.randn(sequences, max_seq, dim, generator=g).to(dtype)
    return q, weights, cache, rows, positions, dim ** -0.5


def test_reference_is_the_weighted_relu_sum_per_key_and_minus_infinity_past_the_position():
    q, weights, cache, rows, positions, scale = case()
    got = index_scores_reference(q, weights, cache, rows, positions, scale)
    for t in range(len(positions)):
        for j in (0, int(positions[t]), min(int(positions[t]) + 1, 149)):
            want = sum(float(weights[t, h]) * max(0.0, float(q[t, h].double() @ cache[rows[t], j].double()))
                       for h in range(q.shape[1])) * scale
            if j > positions[t]:
                assert got[t, j] == float("-inf")
            else:
                assert abs(float(got[t, j]) - want) <= 1e-4 * max(1.0, abs(want)), (t, j)
    assert torch.isinf(got[0, 1:]).all() and torch.isfinite(got[5]).all()


KERNEL_CHECK = """
import torch
from test_indexer_kernel import case
from piecewise.kernels.indexer import index_scores, index_scores_reference
for seed in (0, 1):
    args = case(seed)
    got, want = index_scores(*args), index_scores_reference(*args)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "masks differ"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)
print("kernel matches")
"""


def test_kernel_under_the_triton_interpreter_matches_the_reference():
    run_interpreted(KERNEL_CHECK)
