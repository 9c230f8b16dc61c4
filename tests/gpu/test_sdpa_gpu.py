"""``kernels.attention.sdpa``: SDPA without cuDNN's backend, whose execution plan per new shape cost 60-300 ms (a
capture over 51 sizes paid it 51 times; a prefill at every new prompt length). Same values as the math backend,
no cuDNN kernel launched, and torch's flag as the caller left it, also when SDPA raises."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from piecewise.kernels.attention import sdpa

pytestmark = pytest.mark.gpu


def _cases():
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)

    keys = randn(3, 4, 96, 128)
    mask = torch.ones(3, 1, 5, 96, device="cuda", dtype=torch.bool).tril(91)
    return [("decode", (randn(3, 4, 4, 128), keys, keys), {}),
            ("causal prefill", (randn(1, 8, 77, 64), randn(1, 8, 77, 64), randn(1, 8, 77, 64)), {"is_causal": True}),
            ("masked", (randn(3, 4, 5, 128), keys, keys), {"attn_mask": mask, "scale": 0.1})]


@pytest.mark.parametrize("case", range(3))
def test_sdpa_equals_math_and_launches_no_cudnn_kernel(case):
    name, args, kwargs = _cases()[case]
    with sdpa_kernel([SDPBackend.MATH]):
        expected = F.scaled_dot_product_attention(*(a.float() for a in args), **kwargs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = sdpa(*args, **kwargs)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels and not [k for k in kernels if "cudnn" in k.lower()], (name, kernels)
    assert torch.allclose(out.float(), expected, atol=2e-2, rtol=2e-2), (name, (out.float() - expected).abs().max())
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_sdpa_leaves_the_flag_as_it_found_it():
    q = torch.randn(1, 2, 3, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        sdpa(q, q[..., :32], q)  # head dims that differ: SDPA raises
    assert torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        sdpa(q, q, q)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
