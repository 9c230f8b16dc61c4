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


def test_sdpa_keeps_a_callers_choice_of_cudnn_alone():
    """Inside ``sdpa_kernel([CUDNN_ATTENTION])`` leaving cuDNN out would leave no backend: the call is SDPA's own."""
    name, args, kwargs = _cases()[0]
    with sdpa_kernel([SDPBackend.MATH]):
        expected = F.scaled_dot_product_attention(*(a.float() for a in args), **kwargs)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = sdpa(*args, **kwargs)
        assert torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    assert torch.allclose(out.float(), expected, atol=2e-2, rtol=2e-2)


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


class _Attends(torch.nn.Module):
    """Decode-shaped attention over a fixed cache: [T, 512] → [T, 512], through ``attend``."""

    def __init__(self, attend):
        super().__init__()
        self.proj = torch.nn.Linear(512, 512, bias=False)
        self.register_buffer("keys", torch.randn(4, 256, 128))
        self.attend = attend

    def forward(self, x):
        q = self.proj(x).view(-1, 4, 1, 128).transpose(0, 2)  # [1, 4, T, 128]
        out = self.attend(q, self.keys[None], self.keys[None])
        return out.transpose(0, 2).reshape(x.shape)


def _runs_cudnn(model, x) -> bool:
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)
    return any(e.name == "aten::_scaled_dot_product_cudnn_attention" for e in prof.events())


def test_the_doctor_names_cudnn_attention_exactly_when_it_runs():
    import piecewise

    torch.manual_seed(0)
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    for attend in (F.scaled_dot_product_attention, sdpa):
        model = _Attends(attend).cuda().to(torch.bfloat16)
        warned = [w for w in piecewise.doctor(model, x).warnings if "cuDNN backend" in w]
        assert bool(warned) == _runs_cudnn(model, x), (attend.__name__, warned)
        if attend is sdpa:
            assert not warned
